"""Request traces: what a server actually served, from our own recording or a public trace format.

A trace is a list of `TraceRequest`s (arrival, prompt and output lengths, optionally the hash ids of
the prompt's blocks), whatever file it came from: `recorded` (ours, `RecordedRequest` is one line),
`mooncake`, `azure` or `burstgpt`. slotune/tuner/spec/trace_reader.py reads the files; hash ids let a replay
rebuild prompts that share exactly the blocks the traced ones shared (slotune/tuner/workload/prompts.py).
Each format's columns: docs/design/tuner-spec.md.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

TraceFormat = Literal["recorded", "mooncake", "azure", "burstgpt"]
FinishReason = Literal["stop", "length", "abort", "rejected"]  # the engine's (slotune/engine/outputs.py)
MOONCAKE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's published traces
MAX_TOKENS_PER_REQUEST = 2**24  # the bound WorkloadSpec puts on lengths (workload_spec.MAX_LEN)
_HASH_BYTES = 8  # ids are 63-bit non-negative ints: exact in JSON, int64 and numpy


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One traced request, whatever format it came from."""

    arrival_s: float  # since the first kept request, after time_scale
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None  # one id per prompt block of `Trace.block_size` tokens, in order
    is_chat: bool | None = None  # None: the format does not say
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    e2e_s: float | None = None  # measured arrival -> last token (not scaled by time_scale); recordings only


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order, and where they came from."""

    requests: list[TraceRequest]
    source: str
    format: TraceFormat
    block_size: int | None  # tokens per hash id; None when no request has hash ids

    def __len__(self) -> int:
        return len(self.requests)


# --- our recording format ----------------------------------------------------------------------
class RecordedRequest(BaseModel):
    """One line of a recording: a request the server finished (the server writes `model_dump_json()`).

    `hash_ids` are `block_hash_ids(prompt_token_ids, block_size, key=...)`: chained, keyed hashes of
    the prompt's *full* blocks, so equal ids mean equal prompt prefixes, while nobody without the key
    can test a guessed prompt against them. Use one key for a whole recording (all rotated files):
    ids made with different keys never match. Omit `hash_ids` (and `block_size`) to record lengths only.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    arrival: float = Field(gt=0, description="unix seconds when the server received the request")
    finish: float | None = Field(None, gt=0, description="unix seconds when its last token was sent")
    prompt_tokens: int = Field(ge=1, le=MAX_TOKENS_PER_REQUEST, description="after the chat template")
    max_tokens: int | None = Field(None, ge=1, description="as requested; None when the client set none")
    output_tokens: int = Field(ge=0, le=MAX_TOKENS_PER_REQUEST, description="tokens produced")
    finish_reason: FinishReason
    chat: bool = Field(description="came in through /v1/chat/completions")
    cached_tokens: int = Field(0, ge=0, description="prompt tokens served from the prefix cache")
    block_size: int | None = Field(None, ge=1, description="tokens per hash id")
    hash_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(
        None, description="one per full prompt block: prompt_tokens // block_size"
    )

    @model_validator(mode="after")
    def _check(self) -> "RecordedRequest":
        if self.finish is not None and self.finish < self.arrival:
            raise ValueError(f"finish ({self.finish}) is before arrival ({self.arrival})")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        if self.hash_ids is not None:
            if self.block_size is None:
                raise ValueError("hash_ids needs block_size (tokens per id)")
            num_full = self.prompt_tokens // self.block_size
            if len(self.hash_ids) != num_full:
                raise ValueError(
                    f"hash_ids has {len(self.hash_ids)} ids, but {self.prompt_tokens} prompt tokens "
                    f"fill {num_full} full blocks of {self.block_size}"
                )
        return self


def block_hash_ids(token_ids: Sequence[int], block_size: int, *, key: bytes = b"") -> list[int]:
    """Chained hashes of the full blocks of `token_ids`: id i covers tokens [0, (i+1) * block_size).

    Args:
        token_ids: the prompt, after the chat template.
        block_size: tokens per block; a last, partial block gets no id.
        key: up to 64 bytes (BLAKE2b's key); keep it secret to keep recorded prompts private.
    Returns:
        `len(token_ids) // block_size` ints in [0, 2**63).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=_HASH_BYTES, key=key)
        h.update(array("Q", token_ids[start : start + block_size]).tobytes())
        parent = h.digest()
        out.append(int.from_bytes(parent, "little") >> 1)
    return out


# --- options -------------------------------------------------------------------------------------
class TraceSource(BaseModel):
    """Which trace to replay and how: the `trace:` mapping of a workload, and `load_trace`'s options."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    path: str = Field(min_length=1, description="a trace file, or a directory of recorded *.jsonl files")
    format: TraceFormat | None = Field(None, description="default: detected from the file")
    block_size: int | None = Field(
        None,
        ge=1,
        description=f"tokens per hash id for mooncake (default {MOONCAKE_BLOCK_SIZE}); recordings say their own",
    )
    time_scale: float = Field(1.0, gt=0, description="multiplies every gap: 2.0 replays at half speed")
    window: tuple[float, float] | None = Field(
        None,
        description="[start_s, end_s): keep requests arriving in this span, seconds since the trace's "
        "first request (before time_scale)",
    )
    max_requests: int | None = Field(None, ge=1, description="keep the first this many (after window)")

    @model_validator(mode="after")
    def _check(self) -> "TraceSource":
        if self.window is not None and not 0 <= self.window[0] < self.window[1]:
            raise ValueError(f"window: need 0 <= start_s < end_s, got {list(self.window)}")
        return self
