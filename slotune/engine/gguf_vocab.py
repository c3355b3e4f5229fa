"""A GGUF file's vocabulary as a `tokenizers` pipeline that splits text as the model's own
tokenizer does.

Two vocabularies (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (tokens + merges). Words are cut by a regex that depends on the model
  family, named by `tokenizer.ggml.pre`; llama.cpp keeps the table (src/llama-vocab.cpp,
  `llm_tokenizer_bpe`) and convert_hf_to_gguf.py picks the name from the HF tokenizer. Each
  supported name maps here to the pre-tokenizer of that family's HF tokenizer.json.
- "llama": SentencePiece BPE (Llama 1/2, Mistral 7B v0.1-v0.3): tokens + scores + types. Both
  SentencePiece and llama.cpp merge the adjacent pair whose merged piece scores highest; a BPE
  whose merge ranks follow those scores, with byte fallback, does the same (HF's LlamaConverter).

Anything else is refused by name before a weight is read (checkpoint.check_gguf_vocab): a wrong
split gives fluent-looking but wrong output, so there is no default. The tables here import without
`tokenizers`, which only building a vocabulary loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regexes as the families' tokenizer.json files write them (llama.cpp spells the case-insensitive
# contractions out because its regex engine lacks (?i:); the matches are the same).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How one family cuts text into words before byte-level BPE."""

    split: str | None = None  # a regex whose matches become words; None: GPT-2's regex (ByteLevel's own)
    individual_digits: bool = False  # every digit its own word, before the regex (StarCoder, SmolLM)
    nfc: bool = False  # NFC-normalize first (Qwen2's tokenizer.json; llama.cpp skips it)
    ignore_merges: bool = False  # a word that is a token is that token (Llama 3's tokenizer.json)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token

    def build(self) -> Any:
        from tokenizers import Regex, pre_tokenizers

        if self.split is None:
            steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        else:
            steps = [
                pre_tokenizers.Split(Regex(self.split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        if self.individual_digits:
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        return pre_tokenizers.Sequence(steps)


_STARCODER = PreTokenizer(individual_digits=True)
_LLAMA3 = PreTokenizer(LLAMA3_SPLIT, ignore_merges=True, add_bos=True)

# `tokenizer.ggml.pre` -> pipeline: the names llama.cpp gives the same regex (and options), for the
# tokenizers of models this engine's architectures (llama, qwen2) carry. Names whose HF tokenizer
# adds a step llama.cpp's table lacks (e.g. a normalizer) are left out until checked.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "gpt-2": PreTokenizer(),
    "smollm": _STARCODER,
    "starcoder": _STARCODER,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "falcon3": _LLAMA3,
    "pixtral": _LLAMA3,
    "smaug-bpe": PreTokenizer(LLAMA3_SPLIT),
    "qwen2": PreTokenizer(QWEN2_SPLIT, nfc=True),
}
VOCABULARIES = ("gpt2", "llama")


@dataclass(frozen=True, slots=True)
class GGUFVocab:
    tokenizer: HFTokenizer
    add_bos: bool  # llama.cpp's rule: the file's tokenizer.ggml.add_bos_token, else the vocabulary's default


def gguf_vocab(meta: dict[str, Any], path: Path) -> GGUFVocab:
    """The tokenizer of a GGUF file from its metadata (`gguf_header.gguf_metadata`); no tensor is read.
    What is refused, `checkpoint.check_gguf_vocab` says."""
    from slotune.engine.checkpoint import check_gguf_vocab  # it imports this module's tables

    check_gguf_vocab(path, meta)
    if meta["tokenizer.ggml.model"] == "gpt2":
        return _byte_level_bpe(meta)
    return _sentencepiece_bpe(meta)


def _byte_level_bpe(meta: dict[str, Any]) -> GGUFVocab:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    pre = PRE_TOKENIZERS[meta["tokenizer.ggml.pre"]]
    tokens, types = _tokens(meta)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
    )
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre.build()
    tok.decoder = decoders.ByteLevel()
    _add_atomic_tokens(tok, tokens, types)
    return GGUFVocab(tok, bool(meta.get("tokenizer.ggml.add_bos_token", pre.add_bos)))


def _sentencepiece_bpe(meta: dict[str, Any]) -> GGUFVocab:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    tokens, types = _tokens(meta)
    scores = meta["tokenizer.ggml.scores"]
    unk = [t for t, ty in zip(tokens, types) if ty == UNKNOWN]
    # SentencePiece merges only into normal pieces; control, byte and unused pieces never form from text.
    normal = {t for t, ty in zip(tokens, types) if ty == NORMAL}
    ranked = []
    for i, piece in enumerate(tokens):
        if piece in normal:
            ranked += [
                (-float(scores[i]), i, piece[:cut], piece[cut:])
                for cut in range(1, len(piece))
                if piece[:cut] in normal and piece[cut:] in normal
            ]
    ranked.sort()  # the highest-scoring merged piece first (ties: the lower id, as SentencePiece orders pieces)
    tok = HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[(a, b) for _, _, a, b in ranked],
            unk_token=unk[0] if unk else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # llama.cpp: a space before the text (and after each special token) unless add_space_prefix is false,
    # and every space as U+2581 -- the normalizer of HF's legacy Llama tokenizer.
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
        ]
    )
    _add_atomic_tokens(tok, tokens, types)
    return GGUFVocab(tok, bool(meta.get("tokenizer.ggml.add_bos_token", True)))


def _tokens(meta: dict[str, Any]) -> tuple[list[str], list[int]]:
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    return tokens, [int(t) for t in types]


def _add_atomic_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens (<|im_end|>, </s>) and user-defined ones match whole in the text and are
    never cut by BPE, as llama.cpp partitions them out first; only control tokens are special
    (skipped when decoding)."""
    from tokenizers import AddedToken

    pairs = list(zip(tokens, types))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in pairs if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in pairs if ty == USER_DEFINED])
