"""examples/05-own-model, pointed (as its README says) at a model directory laid out like a user's:
a tiny random Llama saved by transformers with a byte-level BPE tokenizer and Qwen2.5's chat
template. The spec must validate and resolve, and the engine it configures must load that
directory, build the workload's chat prompts with the model's template and answer them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from slotune.engine import LLM
from slotune.tuner.measure.in_process_replay import run_in_process_replay
from slotune.tuner.spec.tuning_spec import TuningSpec, resolved_dict
from tests.tokenizer_files import GPT2_PIPELINE, train_bpe, write_hf_tokenizer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "05-own-model" / "spec.yaml"
QWEN25_TEMPLATE = ROOT / "tests" / "engine_tests" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from tests.engine_tests.test_model_families import _hf

    d = tmp_path_factory.mktemp("my-model")
    tok = train_bpe(GPT2_PIPELINE, 512, special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    _hf(
        d,
        "LlamaConfig",
        vocab_size=512,
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    write_hf_tokenizer(
        d, tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN25_TEMPLATE.read_text()
    )
    return d


def _spec(model: Path) -> TuningSpec:
    """The example spec with `model:` set to the user's directory, as the README's sed does."""
    data = yaml.safe_load(EXAMPLE.read_text())
    assert data["model"] == "./my-model"  # the placeholder the README tells users to replace
    return TuningSpec.model_validate({**data, "model": str(model)})


def test_own_model_spec_resolves_and_serves_its_workload(user_model):
    spec = _spec(user_model)
    assert resolved_dict(spec)["engine"]["model"] == str(user_model)
    llm = LLM(spec.base_config())
    assert llm.tokenizer.chat_template_source == "tokenizer_config.json: chat_template"
    workload = spec.workload.model_copy(update={"num_requests": 3, "warmup_requests": 1, "concurrency": 2})
    res = run_in_process_replay(None, workload, llm=llm)
    assert len(res.records) == 3 and res.metrics["output_tokens_per_s"] > 0
    assert llm.engine.eos_token_ids == {llm.tokenizer.token_to_id("<|im_end|>")}  # config.json and tokenizer_config
