"""The bundled inference engine. Heavy modules load lazily so config-only users skip torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotune.engine.config import EngineConfig
from slotune.engine.outputs import RequestMetrics, RequestOutput
from slotune.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from slotune.engine.llm import LLM, PromptLogprobs
    from slotune.engine.llm_engine import EngineStats, LLMEngine, RequestRejected

_LAZY = {
    "LLM": "slotune.engine.llm",
    "PromptLogprobs": "slotune.engine.llm",
    "LLMEngine": "slotune.engine.llm_engine",
    "RequestRejected": "slotune.engine.llm_engine",
    "EngineStats": "slotune.engine.llm_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'slotune.engine' has no attribute '{name}'")


__all__ = [
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "RequestMetrics",
    "LLM",
    "PromptLogprobs",
    "LLMEngine",
    "RequestRejected",
    "EngineStats",
]
assert set(__all__) >= set(_LAZY)
