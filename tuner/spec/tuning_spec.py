"""TuningSpec: the one YAML file a user writes (model, workload, SLO objective, gates, space, budget).

Validated and resolved once, at load; every problem is reported as `field.path: message`, unknown
keys are errors, NaN and inf are refused, and the file is read by `tuner.errors.load_yaml` (plain
YAML: no tags, no duplicate keys, bounded alias expansion). References are resolved in the same pass:
`workload` becomes a WorkloadSpec, `search_space` a SearchSpace, `quality_gates` GateSpecs (a
built-in name, a file or the mapping itself), so the rest of the code gets objects, never names.
`engine` stays the user's overrides (checked as an EngineConfig); `base_config()` merges them.

Paths in a spec (model, workload, search_space, workload.trace or workload.trace.path, output_dir,
a sqlite storage or MLflow URL, speculative.draft_model) are relative to the spec file's folder:
`from_yaml` resolves them while validating, so the spec means the same from any working directory.
`preflight` then checks what needs the file system or the model: the model and its context
length, the trace rows, and that the output and storage locations can be written.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from slotune.engine.config import DEFAULT_MODEL, EngineConfig
from slotune.evals.gate_spec import GateSpec
from slotune.evals.tasks import data_dir as tasks_data_dir
from slotune.search_spaces.schema import SearchSpace, builtin_spaces
from slotune.tuner.spec.yaml_reader import Problem, SpecError, load_yaml_mapping, parse_yaml
from slotune.tuner.spec.slo import COST_METRICS, LATENCY_METRICS, METRICS_OF_KIND, THROUGHPUT_METRICS, metric_key
from slotune.tuner.spec.traces import load_trace
from slotune.tuner.spec.workload_spec import (
    MAX_SEED,
    WorkloadSpec,
    builtin_workloads,
    describe_replay,
    read_trace,
    resolve_trace_path,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Objective(_Strict):
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
    def _check(self) -> "Objective":
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


class Cost(_Strict):
    """The price the cost metrics are computed at (tuner/metrics.py: cost_metrics)."""

    usd_per_hour: float = Field(
        gt=0,
        description="price of one replica (one accelerator, or the machine a trial runs on) for an hour, in US dollars",
    )


class Budget(_Strict):
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


class EarlyStop(_Strict):
    enabled: bool = True
    min_requests: int = Field(3, ge=1)
    factor: float = Field(3.0, gt=1, description="stop when the partial pXX exceeds factor x the limit")


class Sweep(_Strict):
    """The load sweep after a study (tuner/sweep.py): the winner, the default and the naive config
    measured at rising load up to saturation; their latency-throughput curves and capacity in the report."""

    enabled: bool = Field(False, description="sweep after the study (each point a measurement: minutes)")
    steps: int = Field(6, ge=2, le=16, description="load points per config, at most")
    min_requests: int = Field(8, ge=1, description="measured requests per point, at least (more at high load)")


class Screening(_Strict):
    """Multi-fidelity screening (tuner/screening.py decides, `Objective._screen` replays).

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


class TuningSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=128)
    model: str = Field(
        DEFAULT_MODEL,
        min_length=1,
        description="a bundled name, a .gguf file or an HF checkpoint dir "
        "(a relative path is relative to the spec file's folder)",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="fixed EngineConfig fields for every trial (not `model`: that is the top-level field)",
    )
    workload: WorkloadSpec = Field(
        "chat-small",
        validate_default=True,
        description="a built-in workload name, a "
        "YAML file (relative to the spec's folder) or the workload itself; resolved at load",
    )
    objective: Objective
    quality_gates: list[GateSpec] = Field(default_factory=list)
    search_space: SearchSpace = Field(
        "latency",
        validate_default=True,
        description="a built-in search space name, a YAML file or the space itself; resolved at load",
    )
    budget: Budget = Budget()
    sampler: Literal["tpe", "random", "nsga2", "gp", "grid"] = "tpe"
    seed: int = Field(0, ge=0, le=MAX_SEED)
    storage: str | None = Field(None, description="Optuna storage URL; default sqlite:///<output_dir>/study.db")
    mlflow_tracking_uri: str | None = Field(None, description="default sqlite:///<output_dir>/mlflow.db")
    output_dir: str | None = Field(None, description="default runs/<name> (in the working directory)")
    early_stop: EarlyStop = EarlyStop()
    robustness_seed: int = Field(
        1000,
        ge=0,
        le=MAX_SEED,
        description="workload seed of the confirmation round "
        "(re-measuring the best trials and the default before the winner is declared)",
    )
    cost: Cost | None = Field(
        None,
        description="price per replica-hour: every trial then reports $ per 1M output "
        "and total tokens; needed by a cost objective",
    )
    peak_rps: float | None = Field(
        None,
        gt=0,
        description="requests/s at peak traffic: with `sweep`, the report says "
        "how many replicas of each config serve it within the SLO",
    )
    sweep: Sweep = Sweep()
    screening: Screening = Field(
        Screening(),
        description="multi-fidelity screening: a short replay first, the full "
        "one only for promising configs (off by default)",
    )

    @field_validator("model")
    @classmethod
    def _model_ok(cls, v: str, info: ValidationInfo) -> str:
        return _resolve_path(v, _base_dir(info), name_ok=True)

    @field_validator("engine")
    @classmethod
    def _engine_ok(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "model" in v:
            raise ValueError(
                "engine.model: the model is the top-level `model:` field of the spec (engine.model would "
                "be replaced by it); move it there"
            )
        _refuse_non_finite(v, "engine")
        spec = v.get("speculative")
        if isinstance(spec, dict) and isinstance(spec.get("draft_model"), str):
            v = {**v, "speculative": {**spec, "draft_model": _resolve_path(spec["draft_model"], _base_dir(info))}}
        _validate_nested(EngineConfig, v)
        return v

    @field_validator("workload", mode="before")
    @classmethod
    def _workload_ok(cls, v, info: ValidationInfo) -> WorkloadSpec:
        if isinstance(v, dict):
            base = _base_dir(info)
            try:
                if base is not None:
                    v = resolve_trace_path(v, base)
                wl = _validate_nested(WorkloadSpec, v)
                wl.check_trace_exists()
            except SpecError as exc:
                raise ValueError("; ".join(f"workload.{p.field}: {p.message}" for p in exc.problems)) from None
            return wl
        return _load_part(WorkloadSpec, v, info, builtin_workloads(), "workload")

    @field_validator("search_space", mode="before")
    @classmethod
    def _space_ok(cls, v, info: ValidationInfo) -> SearchSpace:
        return _load_part(SearchSpace, v, info, builtin_spaces(), "search space")

    @field_validator("quality_gates", mode="before")
    @classmethod
    def _gates_ok(cls, v) -> list[GateSpec]:
        if not isinstance(v, list):
            raise ValueError("a list of gates")
        gates: list[GateSpec] = []
        for i, g in enumerate(v):
            gate = g if isinstance(g, GateSpec) else _validate_nested(GateSpec, g, prefix=f"[{i}]")
            if any(gate.name == other.name for other in gates):
                raise ValueError(f"[{i}]: gate name '{gate.name}' used twice; names identify gates in reports")
            if gate.kind != "agreement":
                metrics = _task_metrics(gate.task)
                if gate.metric_name not in metrics:
                    raise ValueError(
                        f"[{i}] gate '{gate.name}': metric '{gate.metric_name}' is not reported by task "
                        f"'{gate.task}' (its metrics: {', '.join(metrics)})"
                    )
            gates.append(gate)
        return gates

    @field_validator("output_dir")
    @classmethod
    def _output_ok(cls, v, info: ValidationInfo):
        return None if v is None else _resolve_path(v, _base_dir(info))

    @field_validator("storage", "mlflow_tracking_uri")
    @classmethod
    def _url_ok(cls, v, info: ValidationInfo):
        if v is None:
            return v
        if info.field_name == "mlflow_tracking_uri" and not v.startswith("sqlite:"):
            return v  # MLflow also takes http(s)://, file: and other stores; only sqlite paths are resolved here
        return _check_storage_url(v, _base_dir(info))

    @model_validator(mode="after")
    def _check(self) -> "TuningSpec":
        if self.sampler == "grid":
            self.search_space.grid()  # raises for float knobs without a step
        if self.objective.pareto_with and self.sampler not in ("nsga2", "tpe", "random", "gp"):
            raise ValueError(f"sampler '{self.sampler}' cannot run a multi-objective study")
        priced = [m for m in self.objective.metrics if m in COST_METRICS]
        if priced and self.cost is None:
            what = "objective.kind 'cost'" if self.objective.kind == "cost" else f"objective.pareto_with '{priced[0]}'"
            raise ValueError(
                f"{what} needs cost.usd_per_hour (the price of one replica for an hour), which is not "
                "set; add `cost: {usd_per_hour: 2.5}` to the spec"
            )
        if self.screening.enabled:
            self._check_screening()
        return self

    def _check_screening(self) -> None:
        if len(self.objective.metrics) > 1:
            raise ValueError(
                "screening.enabled: Optuna prunes single-objective studies only, and objective.pareto_with "
                "makes this one multi-objective; drop one of them"
            )
        if self.sampler not in ("tpe", "random"):
            raise ValueError(
                f"screening.enabled: sampler '{self.sampler}' learns nothing from screened-out (pruned) "
                "trials and would propose them again; use sampler tpe or random with it"
            )
        wl = self.workload
        is_trace_replay = wl.trace is not None and not isinstance(wl.trace, str)
        if is_trace_replay or wl.num_requests is None or wl.duration_s is not None:
            raise ValueError(
                "screening.enabled: the short replay is the workload's first requests, so the workload "
                "needs num_requests and no duration_s or trace replay; set workload.num_requests"
            )
        if self.screening.share(wl) >= 1:
            raise ValueError(
                f"screening.enabled: the short replay would be the whole workload "
                f"({wl.num_requests} requests; at least screening.min_requests = "
                f"{self.screening.min_requests}{' and concurrency' if wl.is_closed_loop else ''}); "
                "lower screening.min_requests or raise workload.num_requests"
            )

    # --- resolution ------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | Path) -> "TuningSpec":
        """Load and validate a spec file; its relative paths resolve against its folder.

        Raises MissingFileError / SpecError for the file itself (YAML problems name line and
        column), pydantic.ValidationError for its fields.
        """
        path = Path(path)
        data = load_yaml_mapping(path, "spec file")
        return cls.model_validate(data, context={"base_dir": Path(os.path.abspath(path)).parent})

    def base_config(self) -> EngineConfig:
        return EngineConfig.model_validate({**self.engine, "model": self.model})

    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    def resolved_storage(self) -> str:
        return self.storage or f"sqlite:///{(self.resolved_output_dir() / 'study.db').resolve()}"

    def resolved_tracking_uri(self) -> str:
        return self.mlflow_tracking_uri or f"sqlite:///{(self.resolved_output_dir() / 'mlflow.db').resolve()}"


def default_spec_path() -> Path:
    """The built-in quickstart spec `tune run` uses when given none."""
    return Path(str(resources.files("slotune.tuner") / "specs" / "quickstart.yaml"))


def resolved_dict(spec: TuningSpec) -> dict[str, Any]:
    """The spec with every reference resolved: workload, search space, defaults, output paths."""
    d = spec.model_dump(mode="json")
    d["workload"] = spec.workload.model_dump(mode="json", exclude_none=True)
    d["search_space"] = spec.search_space.model_dump(mode="json", exclude_none=True)
    d["quality_gates"] = [g.model_dump(mode="json", exclude_none=True) for g in spec.quality_gates]
    d["output_dir"] = str(spec.resolved_output_dir())
    d["storage"] = spec.resolved_storage()
    d["mlflow_tracking_uri"] = spec.resolved_tracking_uri()
    d["engine"] = spec.base_config().model_dump(mode="json", exclude_defaults=True)
    return d


def validate_command(spec: Path) -> TuningSpec:
    """`tune validate`: load and check SPEC (`from_yaml`, then `preflight`), then print what it resolves to.

    Args:
        spec: path of the tuning spec YAML.

    Returns:
        The validated TuningSpec. Raises pydantic.ValidationError / SpecError (a ValueError) /
        MissingFileError for bad input (the CLI prints them as `path: field: message` lines).
    """
    from rich.console import Console
    from rich.syntax import Syntax

    s = TuningSpec.from_yaml(spec)
    preflight(s)
    space, wl = s.search_space, s.workload
    obj = s.objective
    c = Console()
    c.print(
        f"[green]ok[/green] {spec}: study '{s.name}', {obj.kind} objective {obj.direction()} {obj.metric_key()}"
        + (f" (Pareto with {', '.join(obj.metric_key(m) for m in obj.pareto_with)})" if obj.pareto_with else ""),
        highlight=False,
    )
    replay = describe_replay(wl)
    requests = f"{wl.num_requests} requests" if replay is None else "the trace's requests"
    c.print(
        f"  workload: {wl.name} ({wl.arrivals}, {requests}); search space: {space.name} "
        f"({len(space.knobs)} knobs); gates: {len(s.quality_gates)}; sampler: {s.sampler}; "
        f"budget: {s.budget.n_trials} trials, measured {s.budget.measure.replace('_', ' ')}, "
        + (f"the best {s.budget.confirm_top_k} confirmed" if s.budget.confirm_top_k else "no confirmation round")
        + (f"; price ${s.cost.usd_per_hour:g}/hour" if s.cost else ""),
        highlight=False,
    )
    if replay is not None:
        c.print(f"  traffic: {replay}", highlight=False)
    text = yaml.safe_dump(resolved_dict(s), sort_keys=False)
    if c.is_terminal:  # wrapped, never cropped at the terminal's width
        c.print(Syntax(text, "yaml", theme="ansi_dark", background_color="default", word_wrap=True))
    else:  # piped: the YAML as it is, one line per line, usable as a file
        sys.stdout.write(text)
    return s


# --- validation helpers --------------------------------------------------------------------------
def _base_dir(info: ValidationInfo) -> Path | None:
    """The spec file's folder (`from_yaml`), or None for a spec built in code (paths stay as given)."""
    return (info.context or {}).get("base_dir")


def _resolve_path(ref: str, base: Path | None, name_ok: bool = False) -> str:
    """`ref` against the spec's folder; with `name_ok`, a bare name (no separator, no leading '.' or '~',
    nothing of that name in the folder) is kept as a name (a bundled model)."""
    if "\x00" in ref:
        raise ValueError("contains a NUL character")
    p = Path(ref).expanduser()
    if p.is_absolute() or base is None:
        return str(p) if not name_ok or p.is_absolute() else ref
    if (
        name_ok
        and "/" not in ref
        and os.sep not in ref
        and not ref.startswith((".", "~"))
        and p.suffix != ".gguf"
        and not (base / p).exists()
    ):
        return ref
    return os.path.normpath(base / p)


def _resolve_ref(ref: str, base: Path | None, builtins: dict[str, Path]) -> str:
    """A workload / search space reference: a file next to the spec, a built-in name, or a path."""
    if "\x00" in ref:
        raise ValueError("contains a NUL character")
    if base is not None and (base / ref).exists():
        return os.path.normpath(base / ref)
    if ref in builtins:
        return ref
    if Path(ref).suffix not in (".yaml", ".yml", ".json") and "/" not in ref and os.sep not in ref:
        raise ValueError(f"'{ref}' is not a file next to the spec, and not a built-in ({', '.join(sorted(builtins))})")
    return _resolve_path(ref, base)


def _load_part(model, value: Any, info: ValidationInfo, builtins: dict[str, Path], what: str):
    """A workload or search space as the spec gives it: the object, its mapping, or a reference (a file
    next to the spec, a built-in name) whose file's own problems are named by its path."""
    if isinstance(value, model):
        return value
    if isinstance(value, dict):
        return _validate_nested(model, value)
    if not isinstance(value, str):
        raise ValueError(f"a built-in {what} name, a {what} file or a {what} mapping")
    return model.load(_resolve_ref(value, _base_dir(info), builtins))


def _validate_nested(model: type[BaseModel], value: Any, prefix: str = "") -> Any:
    """Validate an embedded section; its problems become one `field: message; ...` error under the section."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ValueError("; ".join(str(p) for p in SpecError.from_validation(exc, prefix=prefix).problems)) from None


def _refuse_non_finite(value: Any, where: str) -> None:
    """EngineConfig's float fields accept inf; a config a user writes must not."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a usable number (NaN and inf are not accepted)")
    if isinstance(value, dict):
        for k, v in value.items():
            _refuse_non_finite(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_non_finite(v, f"{where}[{i}]")


def _check_storage_url(url: str, base: Path | None) -> str:
    """An Optuna (SQLAlchemy) storage URL: parsed, its dialect known, a relative sqlite path resolved."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        parsed.get_dialect()
    except NoSuchModuleError:  # an ArgumentError too: first
        raise ValueError(
            f"'{url}': unknown database kind '{url.split(':', 1)[0]}' (e.g. sqlite, postgresql, mysql)"
        ) from None
    except ArgumentError:
        raise ValueError(
            f"'{url}' is not a database URL (e.g. sqlite:///study.db, postgresql://user@host/db)"
        ) from None
    if (
        parsed.get_backend_name() == "sqlite"
        and parsed.database
        and parsed.database != ":memory:"
        and not parsed.database.startswith("file:")
    ):
        db = _resolve_path(parsed.database, base)
        if db != parsed.database:
            return f"{url.split(':', 1)[0]}:///{db}"
    return url


def _task_metrics(task: str) -> list[str]:
    """The metrics a bundled lm-eval task reports (its template's metric_list)."""
    tmpl = tasks_data_dir() / task.removeprefix("slotune_") / "task.yaml.tmpl"
    data = parse_yaml(tmpl.read_text(), str(tmpl))
    return [m["metric"] for m in data.get("metric_list") or []]


# --- preflight: what needs the file system or the model --------------------------------------------
def preflight(spec: TuningSpec) -> None:
    """Checks a spec needs before a study runs, beyond its own text: the model (and draft) can be found,
    max_model_len fits the model's context, the trace rows are well formed, and the output and storage
    locations can be written. Reads model metadata only (no weights).

    Raises:
        SpecError with one problem per failed check.
    """
    problems: list[Problem] = []

    def run(field: str, check, *args) -> None:
        try:
            check(*args)
        except (SpecError, ValueError, OSError) as exc:
            msgs = [str(p) for p in exc.problems] if isinstance(exc, SpecError) else [str(exc)]
            problems.extend(Problem(m, field=field) for m in msgs)

    run("output_dir", _check_writable_dir, spec.resolved_output_dir())
    for field, url in (("storage", spec.resolved_storage()), ("mlflow_tracking_uri", spec.resolved_tracking_uri())):
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            run(field, _check_writable_file, Path(url[len("sqlite:///") :]))
    wl = spec.workload
    if wl.trace_source is not None:
        run("workload.trace", load_trace, wl.trace_source)
    elif wl.trace:
        run("workload.trace", read_trace, wl.trace)
    base = spec.base_config()
    try:
        problems += _check_context(spec, base)
    except (SpecError, ValueError, OSError) as exc:
        problems.append(Problem(str(exc), field="model"))
    if base.speculative.method == "model":
        run("engine.speculative.draft_model", _model_context, base.speculative.draft_model)
    if problems:
        raise SpecError(problems=problems)


def _first_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_writable_dir(path: Path) -> None:
    anc = _first_existing(path)
    if not anc.is_dir():
        raise ValueError(f"cannot create {path}: {anc} is a file")
    try:
        fd, probe = tempfile.mkstemp(dir=anc, prefix=".slotune-probe-")
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {anc} is not writable ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def _check_writable_file(path: Path) -> None:
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a database file")
    if path.exists():
        try:
            with path.open("ab"):
                pass
        except OSError as exc:
            raise ValueError(f"cannot write {path} ({exc.strerror or exc})") from None
        return
    _check_writable_dir(path.parent)


def _check_context(spec: TuningSpec, base: EngineConfig) -> list[Problem]:
    """max_model_len (the engine's, and every value the space can sample) within the model's context."""
    limit, source = _model_context(spec.model)
    if limit is None:
        return []
    lens = {"engine.max_model_len": [base.max_model_len]}
    for k in spec.search_space.knobs:
        if k.name == "max_model_len":
            lens["search_space"] = list(k.choices) if k.type == "categorical" else [int(k.high)]
    problems = []
    for field, values in lens.items():
        over = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limit]
        if over:
            what = "max_model_len" if field.startswith("engine") else "knob 'max_model_len' can sample"
            problems.append(
                Problem(
                    f"{what} {max(over)}, beyond the model's context of {limit} tokens ({source}); use at most {limit}",
                    field=field,
                )
            )
    return problems


def _model_context(model: str) -> tuple[int | None, str]:
    """The model's context length from its metadata (GGUF `<arch>.context_length`, HF config.json
    `max_position_embeddings`), without loading weights. Raises FileNotFoundError if the model is absent."""
    from slotune.engine.loader import resolve_model_path  # imports torch: only when checking the model

    path = resolve_model_path(model)
    if path.is_dir():
        cfg = _load_json(path / "config.json")
        n = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
        return (n if isinstance(n, int) else None), f"{path / 'config.json'}: max_position_embeddings"
    meta = _gguf_header(path, ("general.architecture",))
    key = f"{meta.get('general.architecture')}.context_length"
    n = _gguf_header(path, (key,)).get(key)
    return (n if isinstance(n, int) else None), f"{path.name}: {key}"


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read: {exc}", source=path) from None


# GGUF value types (gguf-py GGUFValueType): scalar sizes for the struct codes below; 8 = string, 9 = array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_header(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """Scalar and string values of `keys` from a GGUF file's metadata, reading only up to the last one
    found (gguf's GGUFReader decodes every field, the tokenizer's arrays included: seconds per file)."""
    import struct

    want, out = set(keys), {}
    with path.open("rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise SpecError("truncated GGUF metadata", source=path)
            return struct.unpack("<" + fmt, data)[0]

        def read_str() -> str:
            return f.read(read("Q")).decode("utf-8", "replace")

        def skip(vtype: int) -> None:
            if vtype in _GGUF_SCALARS:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[vtype]), 1)
            elif vtype == 8:
                f.seek(read("Q"), 1)
            elif vtype == 9:
                item, count = read("I"), read("Q")
                if item in _GGUF_SCALARS:
                    f.seek(struct.calcsize("<" + _GGUF_SCALARS[item]) * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                raise SpecError(f"unknown GGUF value type {vtype}", source=path)

        if f.read(4) != b"GGUF":
            raise SpecError("not a GGUF file", source=path)
        read("I")  # version
        read("Q")  # tensor count
        for _ in range(read("Q")):
            key, vtype = read_str(), read("I")
            if key in want:
                out[key] = (
                    read(_GGUF_SCALARS[vtype]) if vtype in _GGUF_SCALARS else read_str() if vtype == 8 else skip(vtype)
                )
                if want <= out.keys():
                    break
            else:
                skip(vtype)
    return out
