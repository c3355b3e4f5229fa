"""What the engine hands back: per-request outputs and their timestamps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    scheduled_time: float | None = None  # first time any of it ran
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per output token
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_draft_tokens: int = 0  # speculative tokens proposed
    num_accepted_tokens: int = 0  # speculative tokens accepted

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "rejected"
    metrics: RequestMetrics
    new_token_ids: list[int] = field(default_factory=list)  # produced by the last step
    new_text: str = ""
    error: str | None = None
