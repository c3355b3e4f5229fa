"""The sections of a TuningSpec besides workload and search space.

Objective (the SLO), cost, the winner's confirmation, budget (trials, how a trial is measured), early
stop, sweep and screening. Rationale: docs/design/tuner-spec.md.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator
from slotune.engine.config import StrictModel
from slotune.tuner.spec.slo import COST_METRICS, LATENCY_METRICS, METRICS_OF_KIND, THROUGHPUT_METRICS, metric_key
from slotune.tuner.spec.workload_spec import (
    WorkloadSpec,
)


class ObjectiveSpec(StrictModel):
    """latency: minimise pXX of `metric`; throughput: maximise `metric`; cost: minimise $ per 1M
    output (or total) tokens at the measured throughput and the spec's `cost.usd_per_hour`. Each
    kind subject to whichever limits are set (pXX TTFT/TPOT, `min_output_tokens_per_s`) and the gates."""

    kind: Literal["latency", "throughput", "cost"]
    metric: str = Field(
        description="latency: ttft|tpot|itl|e2e; throughput: output_tokens_per_s|goodput_rps|"
        "requests_per_s; cost: usd_per_1m_output_tokens|usd_per_1m_total_tokens"
    )
    percentile: int = Field(95, ge=50, le=99)
    ttft_limit_s: float | None = Field(None, gt=0)
    tpot_limit_s: float | None = Field(None, gt=0)
    min_output_tokens_per_s: float | None = Field(None, gt=0)
    pareto_with: list[str] = Field(
        default_factory=list, description="extra metrics for a multi-objective (Pareto) run, e.g. [output_tokens_per_s]"
    )

    @model_validator(mode="after")
    def _check(self) -> "ObjectiveSpec":
        allowed = METRICS_OF_KIND[self.kind]
        if self.metric not in allowed:
            raise ValueError(f"metric '{self.metric}' is not a {self.kind} metric; use one of {list(allowed)}")
        if self.metric == "goodput_rps" and self.ttft_limit_s is None and self.tpot_limit_s is None:
            raise ValueError("goodput_rps needs ttft_limit_s and/or tpot_limit_s (what counts as a good request)")
        for i, m in enumerate(self.pareto_with):
            if m not in LATENCY_METRICS + THROUGHPUT_METRICS + COST_METRICS:
                raise ValueError(f"pareto_with: unknown metric '{m}'")
            if m == self.metric:
                raise ValueError(f"pareto_with: '{m}' is already the objective's metric")
            if m in self.pareto_with[:i]:
                raise ValueError(f"pareto_with: '{m}' listed twice")
        return self

    def metric_key(self, metric: str | None = None) -> str:
        m = metric or self.metric
        return metric_key(m, self.percentile) if m in LATENCY_METRICS else m

    def direction(self, metric: str | None = None) -> str:
        return "minimize" if (metric or self.metric) in LATENCY_METRICS + COST_METRICS else "maximize"

    @property
    def metrics(self) -> list[str]:
        return [self.metric, *self.pareto_with]


class Cost(StrictModel):
    """The price the cost metrics are computed at (slotune/tuner/measure/metrics.py: cost_metrics)."""

    usd_per_hour: float = Field(
        gt=0,
        description="price of one replica (one accelerator, or the machine a trial runs on) for an hour, in US dollars",
    )


class Confirm(StrictModel):
    """How the winner is chosen and declared: the default config and the best `candidates` feasible trials,
    each started once and replayed on `seeds` fresh workload seeds (robustness_seed, + 1, ...). The winner
    is the candidate with the best median that held the SLO on every seed; its declared numbers are that
    median and its interval. A config that misses the SLO on a seed is not replayed on the next
    (slotune/tuner/decide/confirm.py, docs/design/confirmation.md)."""

    candidates: int = Field(
        3, ge=0, le=8, description="the best k feasible trials re-measured; 0 = the best trial wins on its own numbers"
    )
    seeds: int = Field(2, ge=1, le=8, description="fresh workload seeds each candidate and the default are measured on")


# The budget's confirmation knobs before the `confirm:` section, refused with what replaces them.
_MOVED_TO_CONFIRM = {
    "confirm_top_k": "confirm.candidates",
    "declare_repeats": "confirm.seeds",
    "confirm_passes": "confirm.seeds",
    "declare_precision": "confirm.seeds",
    "declare_max_repeats": "confirm.seeds",
}


class Budget(StrictModel):
    """How much a study measures: trials and each trial's limits (the winner's confirmation: `Confirm`)."""

    n_trials: int = Field(12, ge=1)
    timeout_s: float | None = Field(None, gt=0, description="wall-clock cap for the whole study")
    trial_timeout_s: float = Field(600, gt=0)
    trial_memory_gb: float = Field(8.0, gt=0)
    trial_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads per trial process (OMP_NUM_THREADS); None = torch's default, one per core",
    )
    # active spins, as `tune serve` runs (fastest on a dedicated machine); passive sleeps (robust on a
    # shared CPU); auto picks passive when more than half the CPU is busy before the first trial.
    trial_omp_wait_policy: Literal["auto", "active", "passive"] = Field(
        "auto",
        description="OpenMP idle threads of a trial: active (spin), passive (sleep) or auto (passive on a busy CPU)",
    )
    # served: the engine behind the OpenAI-compatible HTTP server, replayed over loopback by a client in its
    # own process (the numbers `tune serve` delivers); in_process: replayed on the engine directly (faster
    # trials without HTTP or client cost, so its numbers can be better than what serving delivers).
    measure: Literal["served", "in_process"] = Field(
        "served",
        description="how a trial measures its config: served (as a client of `tune serve` sees it) or in_process",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data):
        old = [k for k in _MOVED_TO_CONFIRM if isinstance(data, dict) and k in data]
        if old:
            new = ", ".join(dict.fromkeys(f"`{_MOVED_TO_CONFIRM[k]}`" for k in old))
            raise ValueError(
                f"{', '.join(old)}: the confirmation's settings moved to the `confirm:` section; use {new} "
                f"(confirm.candidates: trials re-measured, confirm.seeds: fresh seeds each is measured on)"
            )
        return data


class EarlyStop(StrictModel):
    enabled: bool = True
    min_requests: int = Field(3, ge=1)
    factor: float = Field(3.0, gt=1, description="stop when the partial pXX exceeds factor x the limit")


class Sweep(StrictModel):
    """The load sweep after a study (slotune/tuner/sweep.py, slotune/tuner/measure/load_sweep.py): the winner, the default
    and the naive config measured at rising load up to saturation; their curves and capacity in the report."""

    enabled: bool = Field(False, description="sweep after the study (each point a measurement: minutes)")
    steps: int = Field(6, ge=2, le=16, description="load points per config, at most")
    min_requests: int = Field(8, ge=1, description="measured requests per point, at least (more at high load)")


class Screening(StrictModel):
    """Multi-fidelity screening (slotune/tuner/search/screening.py decides, `TrialObjective._screen` replays).

    Every searched trial first replays the head of the workload; only a config whose short-replay
    value is within the `percentile` of its peers' goes on to the full replay and the gates. A
    screened-out trial holds its share of a `budget.n_trials` slot, so the same budget measures more
    configs. Single-objective TPE or random studies only. Details: docs/design/tuner-spec.md.
    """

    enabled: bool = Field(False, description="screen each searched trial on a short replay first")
    fraction: float = Field(0.34, gt=0, lt=1, description="the short replay's share of the workload's requests")
    min_requests: int = Field(8, ge=1, description="the short replay's measured requests, at least")
    percentile: float = Field(
        50.0,
        gt=0,
        lt=100,
        description="go on to the full replay when the short-replay value is "
        "within the best `percentile` % of the peers' (50 = the median)",
    )
    n_startup_trials: int = Field(
        3,
        ge=1,
        description="peers (passed screening, measured in full, met the SLO) needed before any trial is screened out",
    )

    def short_workload(self, wl: WorkloadSpec) -> WorkloadSpec:
        """`wl` cut to the short replay: its first `num_requests(wl)` requests, same seed and shapes."""
        return wl.model_copy(update={"num_requests": self.num_requests(wl)})

    def num_requests(self, wl: WorkloadSpec) -> int:
        """The short replay's measured requests (`wl.num_requests` is set: checked by TuningSpec)."""
        floor = max(self.min_requests, wl.concurrency if wl.is_closed_loop else 1)
        return min(wl.num_requests, max(math.ceil(self.fraction * wl.num_requests), floor))

    def share(self, wl: WorkloadSpec) -> float:
        """The short replay's share of the full one: what a screened-out trial costs the budget."""
        return self.num_requests(wl) / wl.num_requests

    def describe(self, wl: WorkloadSpec) -> str:
        """The short replay in words: "8 of 24 requests"."""
        return f"{self.num_requests(wl)} of {wl.num_requests} requests"
