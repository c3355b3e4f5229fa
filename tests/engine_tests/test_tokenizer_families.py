"""Tokenizers and chat prompts of the supported families, each against an independent reference:

- GGUF byte-level BPE: for each `tokenizer.ggml.pre`, a vocabulary trained here through that
  family's tokenizer.json pipeline (copied from the family's own file) and written into a GGUF as
  convert_hf_to_gguf.py writes it must encode like the family's tokenizer.json.
- GGUF SentencePiece (Llama 2 / Mistral 7B): a SentencePiece BPE model trained here, converted
  as convert_hf_to_gguf.py converts it, must encode and decode like SentencePiece itself.
- Chat prompts: the real templates of Llama 3.2, Qwen2.5, Qwen3 and Mistral Nemo (as their
  tokenizer_config.json ships them, collected in chat_templates/) must render and tokenize like
  transformers' `apply_chat_template`, including the conversations a template refuses.
- Stop ids: every eos id an HF directory declares ends generation.

transformers runs in a child process: in the pytest process it leaves Triton's interpreter
broken for later kernel tests (see test_model_families).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slotune.engine import EngineConfig, SamplingParams
from slotune.engine.serving.async_llm import AsyncLLM
from slotune.engine.chat_template import ChatTemplateError
from slotune.engine.llm_engine import LLMEngine
from slotune.engine.tokenizer import Tokenizer
from slotune.tuner.workload.requests import corpus_text
from tests.engine_driver import generate
from tests.tokenizer_files import (
    BYTE_LEVEL_GPT2,
    EXTRA_TEXT,
    GPT2_PIPELINE,
    gguf_vocab_fields,
    train_bpe,
    write_gguf,
    write_hf_tokenizer,
)

TEMPLATES = Path(__file__).parent / "chat_templates"

# Text that separates the pre-tokenizers: digit runs, contractions in any case, letters of several
# scripts (and a decomposed accent, which NFC composes), whitespace runs, code, control tokens.
STRINGS = [
    "Hello world! 12345 + 3.14159 = 2024-11-22, 1,000,000 and 99999999999.",
    "I'm sure they'll say it's fine; DON'T YOU THINK? We've seen it, you'd agree, she's HE'LL.",
    "naïve café résumé Ångström; Ελληνικά; Россия и Україна; 日本語のテキスト；你好，世界！",
    "e\u0301 versus \u00e9, Emoji 🙂👍🏽 and ❤️",
    "a   b\t\tc\n\n\nd  \n  e   ",
    "   leading spaces and trailing   ",
    "def total(xs):\n    return sum(x * 2 for x in xs if x > 10)  # comment\n\tif (a&&b) { c->d[0]; }\r\n",
    "<|im_start|>user\nWhat is 17*23?<|im_end|>\n<|im_start|>assistant\n<tool_call>",
]


def _split_then_bytes(regex: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


# tokenizer.ggml.pre -> that family's tokenizer.json pipeline, copied from the family's files.
FAMILIES = {
    "gpt-2": GPT2_PIPELINE,
    "smollm": {
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [  # SmolLM2 / StarCoder
                {"type": "Digits", "individual_digits": True},
                BYTE_LEVEL_GPT2,
            ],
        }
    },
    "llama-bpe": {  # Meta-Llama-3-8B
        "pre_tokenizer": _split_then_bytes(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+"
        ),
        "model": {"ignore_merges": True},
    },
    "qwen2": {  # Qwen2 / Qwen2.5 (transformers' Qwen2Converter)
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": _split_then_bytes(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+"
        ),
    },
}
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _gguf_kv(tok, pre: str) -> dict:
    tokens, types, merges = gguf_vocab_fields(tok)
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": tok.token_to_id("<|im_end|>"),
        "tokenizer.ggml.eot_token_id": tok.token_to_id("<|endoftext|>"),
    }


@pytest.mark.parametrize("pre", list(FAMILIES))
def test_gguf_pre_tokenizer_encodes_like_the_family_tokenizer(pre, tmp_path):
    ref = train_bpe(FAMILIES[pre], 1200, special_tokens=SPECIALS, user_tokens=("<tool_call>",))
    kv = _gguf_kv(ref, pre)
    ours = Tokenizer.from_gguf(write_gguf(tmp_path / "model.gguf", kv))
    for s in STRINGS:
        want = ref.encode(s, add_special_tokens=False).ids
        assert ours.encode(s) == want, s
        assert ours.decode(want, skip_special_tokens=False) == ref.decode(want, skip_special_tokens=False)
        assert ours.decode(want) == ref.decode(want, skip_special_tokens=True)
    # llama.cpp stops on eos and eot alike
    assert ours.eos_token_ids == {ref.token_to_id("<|im_end|>"), ref.token_to_id("<|endoftext|>")}
    if pre != "smollm":  # negative control: read with SmolLM2's pre-tokenizer (as every gpt2 GGUF once was), it differs
        wrong = Tokenizer.from_gguf(write_gguf(tmp_path / "as-smollm.gguf", {**kv, "tokenizer.ggml.pre": "smollm"}))
        assert any(wrong.encode(s) != ref.encode(s, add_special_tokens=False).ids for s in STRINGS)


@pytest.mark.parametrize(
    ("kv", "match"),
    [
        (
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "tekken"},
            r"tokenizer\.ggml\.pre 'tekken' is not supported \(supported: .*llama-bpe.*qwen2.*smollm",
        ),
        ({"tokenizer.ggml.model": "gpt2"}, r"tokenizer\.ggml\.pre 'None' is not supported.*re-convert"),
        (
            {"tokenizer.ggml.model": "bert"},
            r"tokenizer\.ggml\.model 'bert' is not supported \(supported: gpt2, llama\)",
        ),
    ],
    ids=["unknown-pre", "missing-pre", "unknown-model"],
)
def test_unsupported_gguf_vocabulary_is_refused_before_any_weight(kv, match, tmp_path):
    # The file has no tensors and no hyperparameters: had the engine read weights first, the
    # loader's KeyError would come out instead of the tokenizer's refusal.
    path = write_gguf(
        tmp_path / "model.gguf", {**kv, "tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    )
    with pytest.raises(ValueError, match=match):
        LLMEngine(EngineConfig(model=str(path), device="cpu"))


def sentencepiece_gguf(tmp_path):
    """A SentencePiece BPE vocabulary trained on the corpus, written as a GGUF the way
    convert_hf_to_gguf.py does. -> (SentencePieceProcessor, GGUF path); skips without sentencepiece."""
    spm = pytest.importorskip("sentencepiece", reason="the reference for SentencePiece GGUF vocabularies")
    # Llama 2's trainer settings: BPE, byte fallback, digits split, no normalization, spaces kept.
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter((corpus_text() + EXTRA_TEXT).splitlines()),
        model_prefix=str(tmp_path / "sp"),
        model_type="bpe",
        vocab_size=1500,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.vocab_size()
    # convert_hf_to_gguf.py's _create_vocab_sentencepiece: pieces, scores, and types from the model
    types = [
        2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 5 if sp.IsUnused(i) else 6 if sp.IsByte(i) else 1
        for i in range(n)
    ]
    path = write_gguf(
        tmp_path / "model.gguf",
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": [sp.IdToPiece(i) for i in range(n)],
            "tokenizer.ggml.scores": [sp.GetScore(i) for i in range(n)],
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": sp.bos_id(),
            "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        },
    )
    return sp, path


def test_sentencepiece_gguf_encodes_and_decodes_like_sentencepiece(tmp_path):
    sp, path = sentencepiece_gguf(tmp_path)
    ours = Tokenizer.from_gguf(path)
    assert (
        any(sp.IsByte(i) for i in range(sp.vocab_size())) and ours.add_bos
    )  # byte pieces exist; llama.cpp adds BOS for SentencePiece vocabularies
    for s in STRINGS[:-1]:  # the last one holds ChatML tokens this vocabulary does not have
        want = sp.encode(s)
        assert ours.encode(s) == want, s
        assert ours.decode(want) == sp.decode(want)
    # A control token in the text is that token; the text after it gets its own leading space, as
    # in llama.cpp (and HF's legacy Llama tokenizer).
    assert ours.encode("</s>Hello there", add_special_tokens=True) == [
        sp.bos_id(),
        sp.eos_id(),
        *sp.encode("Hello there"),
    ]
    assert ours.eos_token_ids == {sp.eos_id()} and ours.special_tokens["bos_token"] == "<s>"


# --- chat templates against transformers -----------------------------------------------------

_CHAT_CHILD = r"""
import json, sys, transformers
spec = json.loads(sys.argv[1])
out = {}
for name, d in spec["dirs"].items():
    tok = transformers.AutoTokenizer.from_pretrained(d)
    for i, conv in enumerate(spec["conversations"]):
        for gen in (False, True):
            key = f"{name}/{i}/{gen}"
            try:
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen, return_dict=True)["input_ids"]
                out[key] = {"text": text, "ids": list(ids)}
            except Exception as exc:
                out[key] = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""

CHAT_TOKENS = {  # template -> (bos_token, eos_token) as the model's tokenizer_config.json names them
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": (None, "<|im_end|>"),
    "Qwen-Qwen3-0.6B": (None, "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
}
TOOL_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris <&> 'Île'"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello, how are you?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?  "},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
    [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],  # Mistral's template refuses this
]


def _chat_dirs(root: Path) -> dict[str, str]:
    specials = (
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|im_start|>",
        "<|im_end|>",
        "<s>",
        "</s>",
        "[INST]",
        "[/INST]",
        "[TOOL_CALLS]",
        "[AVAILABLE_TOOLS]",
        "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]",
        "[/TOOL_RESULTS]",
    )
    tok = train_bpe(FAMILIES["llama-bpe"], 900, special_tokens=specials, user_tokens=("<tool_call>", "</tool_call>"))
    dirs = {}
    for name, (bos, eos) in CHAT_TOKENS.items():
        d = root / name
        write_hf_tokenizer(
            d, tok, bos_token=bos, eos_token=eos, chat_template=(TEMPLATES / f"{name}.jinja").read_text()
        )
        dirs[name] = str(d)
    return dirs


def test_chat_prompts_render_and_tokenize_as_transformers_does(tmp_path):
    pytest.importorskip("transformers")
    dirs = _chat_dirs(tmp_path)
    spec = json.dumps({"dirs": dirs, "conversations": CONVERSATIONS})
    proc = subprocess.run([sys.executable, "-c", _CHAT_CHILD, spec], check=True, capture_output=True, text=True)
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    num_refusals = 0
    for name, d in dirs.items():
        tok = Tokenizer.from_hf_dir(Path(d))
        assert tok.chat_template_source == "tokenizer_config.json: chat_template"
        for i, conv in enumerate(CONVERSATIONS):
            for gen in (False, True):
                want = ref[f"{name}/{i}/{gen}"]
                if "error" in want:  # the same refusal, with the template's own message
                    with pytest.raises(ChatTemplateError) as exc:
                        tok.apply_chat_template(conv, add_generation_prompt=gen)
                    assert want["error"].split(": ", 1)[1] in str(exc.value), (name, i, gen)
                    num_refusals += 1
                    continue
                text = tok.apply_chat_template(conv, add_generation_prompt=gen)
                assert text == want["text"], (name, i, gen)
                assert tok.encode(text) == want["ids"], (name, i, gen)
    assert num_refusals >= 2  # Mistral's alternating-roles check (and its tool-call id check) did fire


def test_chatml_is_only_the_fallback_and_says_so(tmp_path):
    tok = train_bpe(FAMILIES["gpt-2"], 400, special_tokens=SPECIALS)
    write_hf_tokenizer(tmp_path / "own", tok, eos_token="<|im_end|>")
    (tmp_path / "own" / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    write_hf_tokenizer(tmp_path / "none", tok, eos_token="<|im_end|>")
    own, none = Tokenizer.from_hf_dir(tmp_path / "own"), Tokenizer.from_hf_dir(tmp_path / "none")
    msgs = [{"role": "user", "content": "hi"}]
    assert own.chat_template_source == "chat_template.jinja"
    assert own.apply_chat_template(msgs) == "[user] hi\n[assistant] "
    assert none.chat_template_source.startswith("ChatML fallback")
    assert none.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --- stop ids and the served chat path, on a tiny random checkpoint ----------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama (transformers, child process) with a byte-level BPE and Mistral's template;
    config.json declares eos 2 (</s>)."""
    pytest.importorskip("transformers")
    from tests.engine_tests.test_model_families import _hf

    d = tmp_path_factory.mktemp("tiny-llama")
    _hf(d, "LlamaConfig", vocab_size=512, bos_token_id=1, eos_token_id=2)
    tok = train_bpe(FAMILIES["llama-bpe"], 512, special_tokens=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"))
    name = "mistralai-Mistral-Nemo-Instruct-2407"
    write_hf_tokenizer(
        d, tok, bos_token="<s>", eos_token="</s>", chat_template=(TEMPLATES / f"{name}.jinja").read_text()
    )
    return d


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, block_size=8, max_model_len=128))


def test_generation_stops_on_every_eos_id_the_model_declares(checkpoint, tmp_path):
    d = Path(shutil.copytree(checkpoint, tmp_path / "model"))
    prompt = [1, 5, 77, 300, 41, 9]
    greedy = generate(_engine(d), [prompt], 12)[0]  # ignore_eos
    # a token first produced at step k, with no eos (2) before it: the second declared eos id
    k = next(k for k in range(1, 12) if greedy[k] not in greedy[:k] and 2 not in greedy[: k + 1])
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, greedy[k]]}))
    engine = _engine(d)
    assert engine.tokenizer.eos_token_ids == {2, greedy[k]} and engine.tokenizer.eos_token_id == 2
    engine.add_request("r", prompt, SamplingParams(max_tokens=12))
    done = [o for _ in range(40) for o in engine.step() if o.finished]
    assert done[0].output_token_ids == greedy[: k + 1] and done[0].finish_reason == "stop"


def test_a_conversation_the_template_refuses_is_a_400_naming_it(checkpoint):
    from fastapi.testclient import TestClient

    from slotune.engine.serving.server import build_app

    llm = AsyncLLM(EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=64, block_size=8, max_model_len=128))
    with TestClient(build_app(llm)) as client:
        client.portal.call(llm.start)
        try:
            ok = client.post(
                "/v1/chat/completions",
                json={"model": str(checkpoint), "max_tokens": 3, "messages": [{"role": "user", "content": "Hello"}]},
            )
            bad = client.post(
                "/v1/chat/completions",
                json={
                    "model": str(checkpoint),
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
                },
            )
        finally:
            client.portal.call(llm.shutdown)
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] >= 3
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == "messages" and "conversation roles must alternate user/assistant" in err["message"]
