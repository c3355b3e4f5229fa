"""Tokenizer files for tests, made here with the `tokenizers` and `gguf` libraries (no hub):
a byte-level BPE trained on the bundled corpus with one family's tokenizer.json pipeline, saved as
an HF directory's tokenizer files or written into a GGUF the way convert_hf_to_gguf.py writes it."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, trainers
from tokenizers.pre_tokenizers import ByteLevel

from slotune.tuner.workload.requests import corpus_text

# Text the GPL corpus lacks, so that merges cover code, digit runs and multi-byte characters.
EXTRA_TEXT = """
def total(xs: list[int]) -> int:
    return sum(x * 2 for x in xs if x > 10)  # 1234567 3.14159 2024-11-22
if (a && b) { c->d = e[0]; } else { return -1; }
naïve café résumé façade Ångström; Ελληνικά κείμενα; Россия и Україна; 日本語のテキスト；你好，世界！
Emoji 🙂👍🏽 and ❤️. I'm sure they'll say it's fine, DON'T YOU THINK? We've seen it, you'd agree.
"""

# GPT-2's tokenizer.json pipeline: its regex inside the byte-level step.
BYTE_LEVEL_GPT2 = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
GPT2_PIPELINE = {"pre_tokenizer": BYTE_LEVEL_GPT2}


def train_bpe(
    pipeline: dict, vocab_size: int, special_tokens: tuple[str, ...] = (), user_tokens: tuple[str, ...] = ()
) -> Tokenizer:
    """A byte-level BPE trained on the bundled corpus through `pipeline`: the normalizer,
    pre_tokenizer and decoder entries of a family's tokenizer.json, plus `model` options
    (e.g. ignore_merges) as that file writes them. Special tokens get the first ids, user tokens
    (added, not special) the last ones."""
    spec = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": pipeline.get("normalizer"),
        "pre_tokenizer": pipeline["pre_tokenizer"],
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    tok = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(user_tokens),
        special_tokens=list(special_tokens),
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_text(), EXTRA_TEXT], trainer)
    data = json.loads(tok.to_str())
    data["model"].update(pipeline.get("model", {}))  # the trainer keeps vocab + merges, not the family's options
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_tokens])
    return tok


def write_hf_tokenizer(d: Path, tok: Tokenizer, **tokenizer_config) -> None:
    """tokenizer.json + tokenizer_config.json (bos_token, eos_token, chat_template, ...) in `d`."""
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config})
    )


def gguf_vocab_fields(tok: Tokenizer) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types and merges as convert_hf_to_gguf.py's get_vocab_base writes a byte-level
    BPE: added special tokens are CONTROL (3), other added tokens USER_DEFINED (4), the rest NORMAL (1)."""
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        tokens.append(tok.id_to_token(i))
        types.append(1 if i not in added else 3 if added[i].special else 4)
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, types, merges


def write_gguf(path: Path, kv: dict[str, object]) -> Path:
    """A GGUF with `kv` metadata only (llama architecture, no tensors): enough for the tokenizer,
    and a model loader that got this far would fail on the missing hyperparameters."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(v) for v in value])
        elif key == "tokenizer.ggml.token_type":
            w.add_token_types(value)
        else:
            w.add_array(key, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
