"""The sections of a TuningSpec besides workload and search space: objective (the SLO), cost, budget, early stop, sweep, screening."""

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
    """The price the cost metrics are computed at (tuner/metrics.py: cost_metrics)."""

    usd_per_hour: float = Field(
        gt=0,
        description="price of one replica (one accelerator, or the machine a trial runs on) for an hour, in US dollars",
    )


class Budget(StrictModel):
    n_trials: int = Field(12, ge=1)
    confirm_top_k: int = Field(
        3,
        ge=0,
        description="before declaring the winner, re-measure the best k feasible trials on a fresh "
        "workload seed (robustness_seed) in one round, beside the default config measured first and last, and pick "
        "the winner on those numbers (SLO judged again); 0 = off: the best trial wins on its own measurement and "
        "is re-measured once, alone",
    )
    confirm_passes: int = Field(
        3,
        ge=1,
        le=8,
        description="the most passes of the confirmation round: after the first, while another "
        "candidate that met the SLO has a re-measured interval overlapping the winner's, the winner and those "
        "candidates are measured again on the same seed, in reverse order each pass, and compared on their mean "
        "over the passes; 1 = one pass, whatever the overlap",
    )
    declare_repeats: int = Field(
        2,
        ge=0,
        le=8,
        description="after the confirmation round, the winner and the default config measured on at "
        "least this many fresh workload seeds (robustness_seed + 1, + 2, ...; more while declare_precision asks), one "
        "after the other on each; the winner's declared numbers are its median there (of two, their mean), "
        "compared with the default's on the same seeds. The round's own numbers picked the winner, so they favour "
        "it (the best of several noisy measurements is partly the luckiest); 0 = declare the round's numbers",
    )
    declare_precision: float | None = Field(
        0.10,
        gt=0,
        lt=1,
        description="after declare_repeats, keep measuring the winner and the default on further "
        "fresh seeds until the 95% interval of the winner's mean (Student's t over its measurements) is within +- "
        "this fraction of it (a quiet machine stops at declare_repeats, a noisy one measures more), up to "
        "declare_max_repeats; null = exactly declare_repeats",
    )
    declare_max_repeats: int | None = Field(
        None,
        ge=1,
        le=24,
        description="the most declaration measurements declare_precision may take; null = 3 x declare_repeats",
    )
    timeout_s: float | None = Field(None, gt=0, description="wall-clock cap for the whole study")
    trial_timeout_s: float = Field(600, gt=0)
    trial_memory_gb: float = Field(8.0, gt=0)
    trial_threads: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="CPU threads per trial process (OMP_NUM_THREADS); None = torch's default, one per core",
    )
    trial_omp_wait_policy: Literal["auto", "active", "passive"] = Field(
        "auto",
        description="OpenMP idle threads of a trial: active (spin, as `tune serve` runs; fastest on a "
        "dedicated machine) or passive (sleep; robust when the CPU is shared); auto = passive when more than "
        "half the CPU is busy before the first trial",
    )
    measure: Literal["served", "in_process"] = Field(
        "served",
        description="how a trial measures its config: served = as a client of `tune serve` sees it (the "
        "engine behind the OpenAI-compatible HTTP server, the workload replayed over loopback by a client in its own "
        "process: the numbers `tune serve` delivers); in_process = the workload replayed on the engine directly "
        "(faster trials, no HTTP or client cost: its numbers can be better than what serving delivers)",
    )

    @model_validator(mode="after")
    def _declare_cap(self) -> "Budget":
        if self.declare_max_repeats is not None and self.declare_max_repeats < self.declare_repeats:
            raise ValueError(
                f"budget.declare_max_repeats ({self.declare_max_repeats}) is below budget.declare_repeats "
                f"({self.declare_repeats}): raise it, or leave it out (3 x declare_repeats)"
            )
        return self

    @property
    def declare_cap(self) -> int:
        """The most declaration measurements: declare_repeats when declare_precision is off."""
        if self.declare_precision is None:
            return self.declare_repeats
        return self.declare_max_repeats if self.declare_max_repeats is not None else 3 * self.declare_repeats


class EarlyStop(StrictModel):
    enabled: bool = True
    min_requests: int = Field(3, ge=1)
    factor: float = Field(3.0, gt=1, description="stop when the partial pXX exceeds factor x the limit")


class Sweep(StrictModel):
    """The load sweep after a study (tuner/sweep.py): the winner, the default and the naive config
    measured at rising load up to saturation; their latency-throughput curves and capacity in the report."""

    enabled: bool = Field(False, description="sweep after the study (each point a measurement: minutes)")
    steps: int = Field(6, ge=2, le=16, description="load points per config, at most")
    min_requests: int = Field(8, ge=1, description="measured requests per point, at least (more at high load)")


class Screening(StrictModel):
    """Multi-fidelity screening (tuner/screening.py decides, `ObjectiveSpec._screen` replays).

    Every searched trial first replays the head of the workload (the same requests, same seed; a
    share of them, at least `min_requests` and, closed loop, at least `concurrency`). Only a config
    whose short-replay value is as good as the `percentile` of its peers' (the trials before it that
    passed screening, were measured in full and met the SLO) goes on to the full replay and the
    quality gates. A trial screened out holds its share of a slot of `budget.n_trials`, so the same
    budget measures more configs; a trial starts while fewer than n_trials slots are held, so one
    that passes last can take the study past n_trials by less than a slot. The default and naive
    configs are measured in full, never screened. Single-objective studies with TPE or random
    search only: Optuna prunes single-objective studies only, and the other samplers learn nothing
    from pruned trials.
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
