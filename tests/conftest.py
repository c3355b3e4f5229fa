"""Shared fixtures. The real bundled model is loaded once per session and shared."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def llm():
    from slotune.engine import LLM, EngineConfig

    return LLM(EngineConfig(max_num_seqs=8, max_model_len=1024, num_kv_blocks=256))
