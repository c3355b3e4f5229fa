"""Tokenizer built with the `tokenizers` library from GGUF metadata or an HF tokenizer.json.

GGUF stores a gpt2-style byte-level BPE (tokens + merges); we rebuild the same pipeline HF
uses for SmolLM2 (individual digits, then byte-level) and apply the embedded ChatML template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

_DEFAULT_CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """encode/decode plus chat templating; the one tokenizer interface the engine uses."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        chat_template: str | None,
        add_bos: bool = False,
    ) -> None:
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template or _DEFAULT_CHATML
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: Path) -> "Tokenizer":
        from slotune.engine.loader import gguf_metadata

        meta = gguf_metadata(path)
        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"{path}: tokenizer model '{meta.get('tokenizer.ggml.model')}' unsupported (gpt2 BPE only)")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        # Control tokens (type 3) must match atomically and never be split by BPE.
        from tokenizers import AddedToken

        specials = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
        tok.add_special_tokens(specials)
        return cls(
            tok,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> "Tokenizer":
        tok_file = path / "tokenizer.json"
        if not tok_file.exists():
            raise FileNotFoundError(f"{path}: tokenizer.json missing (needed to load an HF checkpoint dir)")
        tok = HFTokenizer.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())

        def _id(name: str) -> int | None:
            t = cfg.get(name)
            if isinstance(t, dict):
                t = t.get("content")
            return tok.token_to_id(t) if t else None

        eos = _id("eos_token")
        if eos is None and (path / "config.json").exists():
            eos = json.loads((path / "config.json").read_text()).get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        return cls(
            tok,
            bos_token_id=_id("bos_token"),
            eos_token_id=eos,
            chat_template=cfg.get("chat_template"),
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

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.chat_template)
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]: each message needs 'role' and 'content'")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
