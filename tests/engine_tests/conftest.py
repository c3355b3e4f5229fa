"""Engine-lever fixtures: build many small engines cheaply.

Reading the tokenizer out of the GGUF costs ~4 s per LLM; the weights themselves come from
the dequantized cache in ~0.3 s. `make_llm` memoizes the tokenizer per model path, so a test
module can afford one engine per configuration it compares.
"""

from __future__ import annotations

import pytest

_TOKENIZERS: dict[str, object] = {}


@pytest.fixture(scope="module")
def make_llm():
    from slotune.engine import LLM, EngineConfig
    from slotune.engine.tokenizer import Tokenizer

    original = Tokenizer.from_model_path

    def cached(path):
        key = str(path)
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = original(path)
        return _TOKENIZERS[key]

    def make(**overrides) -> LLM:
        base = {"max_model_len": 256, "num_kv_blocks": 64, "max_num_seqs": 8}
        return LLM(EngineConfig().with_updates({**base, **overrides}))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Tokenizer, "from_model_path", staticmethod(cached))
        yield make
