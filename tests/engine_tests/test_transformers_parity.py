"""Our engine vs Hugging Face transformers on the same GGUF weights: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from slotune.engine import SamplingParams
from slotune.engine.loader import resolve_model_path

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model():
    path = resolve_model_path("smollm2-135m")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Photosynthesis is the process by which",
]


def test_logits_match_transformers(llm, hf_model):
    for text in PROMPTS + [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])
    ]:
        ids = llm.tokenizer.encode(text)
        ours = llm.logits(ids)
        with torch.no_grad():
            theirs = hf_model(torch.tensor([ids])).logits[0].float()
        assert torch.allclose(ours, theirs, atol=2e-3, rtol=1e-3), (ours - theirs).abs().max()


def test_greedy_tokens_identical_to_transformers(llm, hf_model):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt_ids, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert out.output_token_ids == ref[0, len(prompt_ids) :].tolist()


def test_tokenizer_matches_transformers(llm):
    path = resolve_model_path("smollm2-135m")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in [
        "Hello, world! 12345 + 678",
        "  spaces\tand\nnewlines  ",
        "Ünïcödé ✓ 日本語",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert llm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
        assert llm.tokenizer.decode(llm.tokenizer.encode(text), skip_special_tokens=False) == text


def test_hf_checkpoint_dir_loads_and_matches(llm, hf_model, tmp_path):
    """A local HF-style dir (config.json + safetensors + tokenizer.json) from transformers' own objects."""
    import json

    from safetensors.torch import save_file

    from slotune.engine import LLM, EngineConfig

    path = resolve_model_path("smollm2-135m")
    sd = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(sd, str(tmp_path / "model.safetensors"))
    conf = hf_model.config.to_dict()
    conf.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(tmp_path)
    other = LLM(EngineConfig(model=str(tmp_path), num_kv_blocks=64, max_model_len=512))
    ids = llm.tokenizer.encode(PROMPTS[0])
    assert other.tokenizer.encode(PROMPTS[0]) == ids
    assert torch.allclose(other.logits(ids), llm.logits(ids), atol=1e-4)
    assert other.tokenizer.eos_token_id == llm.tokenizer.eos_token_id
