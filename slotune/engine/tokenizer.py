"""The engine's one tokenizer interface (encode, decode, chat prompt, stop ids), built with the
`tokenizers` library from an HF directory's tokenizer.json or from a GGUF file's vocabulary
(slotune/engine/gguf_vocab.py says which GGUF vocabularies load and which are refused).

Model metadata read here, once:
- the chat template: chat_template.jinja, else tokenizer_config.json's `chat_template`, else the
  GGUF's `tokenizer.chat_template`; ChatML only when the model has none (`chat_template_source`
  says which);
- the special tokens the template sees (bos_token, eos_token, ...);
- every id the model ends a turn with (`eos_token_ids`): an HF directory's generation_config.json
  and config.json `eos_token_id` (an int or a list) and tokenizer_config.json's eos_token; a GGUF's
  tokenizer.ggml.eos_token_id, eot_token_id and eom_token_id (llama.cpp stops on all three).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from slotune.engine.chat_template import CHATML, GEMMA3, render
from slotune.engine.checkpoint import GGUF_STOP_KEYS, GGUF_TOKEN_IDS
from slotune.engine.gguf_header import gguf_metadata
from slotune.engine.gguf_vocab import gguf_vocab

# The special tokens transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES).
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """encode/decode, the chat prompt and the stop ids of one model."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: frozenset[int] = frozenset(),
        chat_template: str | None,
        chat_template_source: str = "",
        special_tokens: dict[str, str] | None = None,
        add_bos: bool = False,
    ) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id  # the primary one (lm-eval's end of text, padding)
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids) | ({eos_token_id} - {None})
        self.chat_template = chat_template or CHATML
        self.chat_template_source = (
            chat_template_source if chat_template else "ChatML fallback (the model has no chat template)"
        )
        self.special_tokens = dict(special_tokens or {})
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        meta = gguf_metadata(path)
        vocab = gguf_vocab(meta, path)  # checks the ids below are inside the vocabulary
        tokens = meta["tokenizer.ggml.tokens"]
        special = {name: tokens[i] for name, key in GGUF_TOKEN_IDS.items() if (i := meta.get(key)) is not None}
        template, source = meta.get("tokenizer.chat_template"), f"{path.name}: tokenizer.chat_template"
        stops = {int(meta[k]) for k in GGUF_STOP_KEYS if meta.get(k) is not None}
        if meta.get("general.architecture") == "gemma3":  # a turn ends with <end_of_turn> (llama.cpp's EOG rule)
            stops |= {i for i, t in enumerate(tokens) if t == "<end_of_turn>"}
            if template is None:
                template, source = GEMMA3, "Gemma 3's template (the GGUF carries none)"
        return cls(
            vocab.tokenizer,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            eos_token_ids=frozenset(stops),
            chat_template=template,
            chat_template_source=source,
            special_tokens=special,
            add_bos=vocab.add_bos,
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{path}: tokenizer.json missing (needed to load an HF checkpoint dir)")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg = _json(path / "tokenizer_config.json")
        legacy_map = _json(path / "special_tokens_map.json")  # older repos keep the special tokens here
        special = {}
        for name in _TEMPLATE_TOKENS:
            value = cfg.get(name, legacy_map.get(name))
            value = value.get("content") if isinstance(value, dict) else value
            if value is not None:
                special[name] = str(value)

        def _id(name: str) -> int | None:
            if name not in special:
                return None
            i = tok.token_to_id(special[name])
            if i is None:
                raise ValueError(
                    f"{path}: {name} '{special[name]}' (tokenizer_config.json) is not in tokenizer.json's vocabulary"
                )
            return i

        declared = [
            *([_id("eos_token")] if "eos_token" in special else []),
            *_token_ids(path / "config.json", "eos_token_id"),
            *_token_ids(path / "generation_config.json", "eos_token_id"),
        ]
        template, source = _hf_chat_template(path, cfg)
        return cls(
            tok,
            bos_token_id=_id("bos_token"),
            eos_token_id=declared[0] if declared else None,
            eos_token_ids=frozenset(declared),
            chat_template=template,
            chat_template_source=source,
            special_tokens=special,
            add_bos=bool(cfg.get("add_bos_token", False)),
        )

    @classmethod
    def from_model_path(cls, path: Path) -> "Tokenizer":
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path)

    # --- use ----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_delta(
        self, ids: list[int], prefix_offset: int, read_offset: int, final: bool = False
    ) -> tuple[str, int, int]:
        """The text `ids[read_offset:]` adds to the decoded `ids[:read_offset]`, in O(new tokens).

        vLLM's incremental detokenization: decode the window from `prefix_offset` (the last text
        boundary before `read_offset`) with and without the new tokens and take the difference,
        so a word's leading space and byte-level merges come out as a whole decode gives them.
        A window ending in an incomplete UTF-8 character gives "" until its bytes are complete
        (`final` emits it as is). Returns (delta, new prefix_offset, new read_offset); start
        with (0, 0).
        """
        before = self.decode(ids[prefix_offset:read_offset])
        text = self.decode(ids[prefix_offset:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return "", prefix_offset, read_offset
        return text[len(before) :], read_offset, len(ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text, as transformers' `apply_chat_template(..., tokenize=False)` renders it; it
        already holds the template's own BOS, so encode it without adding one.

        Raises:
            ChatTemplateError: the template refuses these messages (e.g. roles that do not
                alternate): a client error.
        """
        return render(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
        )


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_ids(path: Path, key: str) -> list[int]:
    """`key` of a JSON config as a list of ids: HF writes an int, a list of ints, or null."""
    value = _json(path).get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: {key} must be a token id or a list of token ids, got {value!r}")
    return values


def _hf_chat_template(path: Path, cfg: dict[str, Any]) -> tuple[str | None, str]:
    """The template transformers would pick with no template name given: chat_template.jinja takes
    priority over tokenizer_config.json; of several named templates, the one named 'default'."""
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text(), "chat_template.jinja"
    template = cfg.get("chat_template")
    source = "tokenizer_config.json: chat_template"
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ValueError(
                f"{path}/tokenizer_config.json: chat_template lists {sorted(named)} but none is named "
                "'default'; add a chat_template.jinja with the template to serve"
            )
        template, source = named["default"], "tokenizer_config.json: chat_template 'default'"
    return template, source
