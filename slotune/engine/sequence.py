"""One request's tokens and bookkeeping. Pure Python: the scheduler is tested without torch."""

from __future__ import annotations

import itertools
from enum import Enum, auto

from slotune.engine.outputs import RequestMetrics
from slotune.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _counter = itertools.count()

    __slots__ = (
        "seq_id",
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "status",
        "block_table",
        "num_computed_tokens",
        "num_cached_tokens",
        "metrics",
        "finish_reason",
        "spec_token_ids",
        "output_text",
        "block_hashes",
        "detok_offsets",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float):
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # of those, served by the prefix cache
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.finish_reason: str | None = None
        self.spec_token_ids: list[int] = []  # draft tokens to verify in the next step
        self.output_text = ""
        self.detok_offsets = (0, 0)  # (prefix, read) into the output ids: Tokenizer.decode_delta
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, {self.status.name})"
