"""Latency against load: one config measured at rising offered load up to saturation, and its capacity.

Each point is measured like a trial (`trial_process.measure`), on the spec's workload with only the load
changed (the concurrency of a closed loop, else the arrival rate), so the numbers are what `tune serve`
delivers. A sweep ends once throughput stops rising, a latency limit is missed by far, or a point fails.
Capacity is the highest load whose point meets the SLO's latency limits with every request completed.
How the loads are picked and why: docs/design/tuner-load-sweep.md."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.trial_process import DEFAULT_TRIAL_RUNNER, TrialFailure, measure
from slotune.tuner.spec.server import ServerConfig, TrialConfig
from slotune.tuner.spec.slo import SLOLimits, judge, metric_key
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.workload_spec import WorkloadSpec

Load = Literal["concurrency", "rate"]


PLATEAU_GAIN = 0.05  # under 5% more output tokens/s ...


PLATEAU_STEPS = 2  # ... on this many steps in a row: saturated


BY_FAR = 2.0  # a latency limit missed by more than this factor: higher loads only queue longer


RATE_TOP = 1.2  # open loop: the highest rate, as a multiple of the saturation throughput


SECONDS_PER_POINT = 4.0  # open loop: arrivals per point span about this long


MAX_REQUESTS = 64


PROBE_SCALE = 1e-6  # a trace's probe: every gap this small, so every request arrives at once


@dataclass(frozen=True)
class LoadPoint:
    """One load measured: the load offered, what was measured (a subset of the trial's metrics), the verdict."""

    offered: float  # concurrency (closed loop) or requests/s offered (open loop)
    num_requests: int
    metrics: dict[str, float] = field(default_factory=dict)  # empty when the measurement failed
    passed: bool = False
    reasons: tuple[str, ...] = ()  # why it misses the SLO, in `slo.judge`'s words
    error: str | None = None  # the measurement failed (TrialFailure's reason)

    @property
    def achieved_rps(self) -> float | None:
        return self.metrics.get("requests_per_s")

    @property
    def tokens_per_s(self) -> float | None:
        return self.metrics.get("output_tokens_per_s")


@dataclass(frozen=True)
class LoadCurve:
    """One config swept: its points in rising offered load, and why the sweep ended."""

    name: str  # winner, default, naive, or a config file's name
    load: Load
    config: dict[str, Any]
    points: tuple[LoadPoint, ...]
    stopped: str  # why the sweep ended, in words
    saturation_rps: float | None = None  # open loop: the probe's requests/s, which the rates are fractions of

    @property
    def capacity(self) -> LoadPoint | None:
        """The point of highest offered load that meets the SLO, or None."""
        ok = [p for p in self.points if p.passed]
        return max(ok, key=lambda p: p.offered) if ok else None

    def replicas(self, peak_rps: float | None) -> int | None:
        """Replicas of this config that serve `peak_rps` within the SLO: ceil(peak / capacity requests/s)."""
        cap = self.capacity
        if peak_rps is None or cap is None or not cap.achieved_rps:
            return None
        return math.ceil(peak_rps / cap.achieved_rps)


@dataclass(frozen=True)
class SweepResult:
    """Every config swept on one workload against one SLO (sweep.json)."""

    workload: str
    limits: SLOLimits
    curves: tuple[LoadCurve, ...]
    peak_rps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        curves = []
        for c in self.curves:
            cap = c.capacity
            curves.append(
                {
                    **asdict(c),
                    "capacity": None
                    if cap is None
                    else {
                        "offered": cap.offered,
                        "requests_per_s": cap.achieved_rps,
                        "output_tokens_per_s": cap.tokens_per_s,
                    },
                    "replicas": c.replicas(self.peak_rps),
                }
            )
        return {"workload": self.workload, "limits": asdict(self.limits), "peak_rps": self.peak_rps, "curves": curves}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepResult":
        curves = tuple(
            LoadCurve(
                c["name"],
                c["load"],
                c["config"],
                tuple(LoadPoint(**{**p, "reasons": tuple(p["reasons"])}) for p in c["points"]),
                c["stopped"],
                c.get("saturation_rps"),
            )
            for c in d["curves"]
        )
        return cls(d["workload"], SLOLimits(**d["limits"]), curves, d.get("peak_rps"))


def load_kind(workload: WorkloadSpec) -> Load:
    return "concurrency" if workload.is_closed_loop else "rate"


def batch_slots(config: TrialConfig) -> int:
    """Requests the config serves at once: the bundled engine's max_num_seqs, or a server's slots."""
    return config.slots() if isinstance(config, ServerConfig) else config.max_num_seqs


def concurrency_steps(max_num_seqs: int, steps: int) -> list[int]:
    """Geometric from 1 to 2 x max_num_seqs, at most `steps` values: (16, 6) -> [1, 2, 4, 8, 16, 32]."""
    top = 2 * max_num_seqs
    return sorted({max(1, round(top ** (i / (steps - 1)))) for i in range(steps)})


def rate_steps(saturation_rps: float, steps: int) -> list[float]:
    """Evenly from RATE_TOP/steps to RATE_TOP x the saturation rate: more points near the knee than a
    geometric series would put there."""
    return [RATE_TOP * saturation_rps * i / steps for i in range(1, steps + 1)]


def point_workload(workload: WorkloadSpec, offered: float, num_requests: int) -> WorkloadSpec:
    """The workload at one load: its concurrency or rate (a trace: its time scale) and its request
    count changed, everything else kept. Validated again, as a trial validates its workload."""
    data = workload.model_dump(mode="json")
    src = workload.trace_source
    if src is not None:
        scale = _trace_rate(src, num_requests) / offered
        data["trace"] = {**data["trace"], "time_scale": scale, "max_requests": num_requests}
    elif workload.is_closed_loop:
        data.update(concurrency=int(offered), num_requests=num_requests, duration_s=None)
    else:
        data.update(rate=offered, num_requests=num_requests, duration_s=None)
    return WorkloadSpec.model_validate(data)


def probe_workload(workload: WorkloadSpec, concurrency: int, num_requests: int) -> WorkloadSpec:
    """An open-loop workload's saturation probe: the same requests closed loop at `concurrency` (a
    trace: all of them at once), whose requests/s the swept rates are fractions of."""
    data = workload.model_dump(mode="json")
    if workload.trace_source is not None:
        data["trace"] = {**data["trace"], "time_scale": PROBE_SCALE, "max_requests": num_requests}
    else:
        data.update(
            arrivals="closed_loop",
            rate=None,
            burstiness=None,
            concurrency=concurrency,
            num_requests=num_requests,
            duration_s=None,
        )
    return WorkloadSpec.model_validate(data)


def _trace_rate(src, num_requests: int) -> float:
    """Requests/s of the first `num_requests` requests of the trace at time scale 1."""
    trace = load_trace(src.model_copy(update={"time_scale": 1.0, "max_requests": num_requests}))
    span = trace.requests[-1].arrival_s
    if len(trace) < 2 or span <= 0:
        raise ValueError(
            f"trace {src.path}: its first {len(trace)} requests arrive at once; a sweep scales its "
            "arrival times, so it needs requests spread in time"
        )
    return (len(trace) - 1) / span


def num_requests(workload: WorkloadSpec, offered: float, min_requests: int, max_requests: int) -> int:
    """Measured requests of a point: closed loop 2 x the concurrency, open loop about SECONDS_PER_POINT of
    arrivals, a trace the same requests at every rate; at least min_requests, open loop at most max_requests."""
    if workload.is_closed_loop:
        return max(min_requests, 2 * int(offered))
    if workload.trace_source is not None:
        return min(max_requests, max(min_requests, 16))
    return min(max_requests, max(min_requests, math.ceil(offered * SECONDS_PER_POINT)))


def _kept(metrics: Measurement, percentile: float) -> dict[str, float]:
    keys = (
        "requests_per_s",
        "output_tokens_per_s",
        "num_requests",
        "num_completed",
        "duration_s",
        "slo_attainment",
        *(metric_key(n, p) for n in ("ttft", "tpot") for p in dict.fromkeys((50, percentile))),
    )
    return {k: float(metrics[k]) for k in keys if metrics.get(k) is not None}


def verdict(metrics: dict[str, float], limits: SLOLimits) -> tuple[bool, tuple[str, ...]]:
    """(meets the SLO, why not): the latency limits (`slo.judge`), and every request completed."""
    reasons = list(judge(metrics, limits.latency_only).reasons)
    n, done = metrics.get("num_requests", 0), metrics.get("num_completed", 0)
    if done < n:
        reasons.append(f"{n - done:.0f} of {n:.0f} requests not completed")
    return not reasons, tuple(reasons)


def _stop_reason(points: list[LoadPoint], limits: SLOLimits) -> str | None:
    last = points[-1]
    if last.error is not None:
        return f"the measurement failed: {last.error}"
    for c in judge(last.metrics, limits.latency_only).checks:
        if c.violation > BY_FAR - 1:
            return f"{c.label} over {BY_FAR:g}x its limit"
    tps = [p.tokens_per_s or 0.0 for p in points[-PLATEAU_STEPS - 1 :]]
    if len(tps) > PLATEAU_STEPS and all(b < a * (1 + PLATEAU_GAIN) for a, b in zip(tps, tps[1:])):
        return f"throughput stopped rising (under {PLATEAU_GAIN:.0%} more on {PLATEAU_STEPS} steps)"
    return None


def measure_point(
    spec,
    config: TrialConfig,
    workload: WorkloadSpec,
    offered: float,
    limits: SLOLimits,
    *,
    runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
    on_phase=None,
) -> LoadPoint:
    """Measure `config` on `workload` (already at the load `offered`) as a trial: early stop off, no gates."""
    point_spec = spec.model_copy(update={"workload": workload, "quality_gates": []})
    n = workload.num_requests or (workload.trace_source.max_requests if workload.trace_source else 0) or 0
    try:
        r = measure(point_spec, config, early_stop=False, runner=runner, on_phase=on_phase)
    except TrialFailure as exc:
        return LoadPoint(offered, n, error=exc.reason, reasons=(f"not measured: {exc.reason}",))
    m = _kept(r.metrics, limits.percentile)
    return LoadPoint(offered, int(m.get("num_requests", n)), m, *verdict(m, limits))


def run_sweep(
    spec,
    config: TrialConfig,
    *,
    name: str,
    steps: int | None = None,
    min_requests: int | None = None,
    max_requests: int = MAX_REQUESTS,
    runner: tuple[str, ...] = DEFAULT_TRIAL_RUNNER,
    on_point: Callable[[str, Load, LoadPoint], None] | None = None,
) -> LoadCurve:
    """Sweep the offered load of `config` on the spec's workload (see the module docstring).

    Args:
        spec: the TuningSpec: workload (its shapes), objective (the SLO), budget (how to measure),
            sweep (steps, min_requests).
        config: the config to sweep: an EngineConfig, or a server's launch.
        name: the curve's name in the report (winner, default, ...).
        steps, min_requests: override `spec.sweep`'s.
        max_requests: measured requests per open-loop point, at most.
        runner: the trial process's command (see `trial_process.run_trial_process`).
        on_point: called with (name, load, point) after each point (and the probe), for progress lines.

    Returns:
        The LoadCurve, points in rising offered load.
    """
    steps = steps or spec.sweep.steps
    min_requests = min_requests or spec.sweep.min_requests
    wl, limits = spec.workload, SLOLimits.from_objective(spec.objective)
    load = load_kind(wl)

    def measured(workload: WorkloadSpec, offered: float) -> LoadPoint:
        point = measure_point(spec, config, workload, offered, limits, runner=runner)
        if on_point is not None:
            on_point(name, load, point)
        return point

    saturation = None
    if load == "concurrency":
        loads: list[float] = list(concurrency_steps(batch_slots(config), steps))
    else:
        n = (
            num_requests(wl, 0, min_requests, max_requests)
            if wl.trace_source is not None  # the swept requests
            else min(max_requests, max(min_requests, 2 * batch_slots(config)))
        )
        probe = measured(probe_workload(wl, batch_slots(config), n), math.inf)
        saturation = probe.achieved_rps
        if not saturation:
            return LoadCurve(
                name,
                load,
                config.model_dump(mode="json"),
                (),
                f"the saturation probe measured nothing: {probe.error or 'no request completed'}",
            )
        loads = rate_steps(saturation, steps)
    points: list[LoadPoint] = []
    stopped = "the highest load was measured"
    for offered in loads:
        points.append(
            measured(point_workload(wl, offered, num_requests(wl, offered, min_requests, max_requests)), offered)
        )
        reason = _stop_reason(points, limits)
        if reason is not None:
            stopped = reason
            break
    return LoadCurve(name, load, config.model_dump(mode="json"), tuple(points), stopped, saturation)
