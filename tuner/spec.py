"""TuningSpec: the one YAML file a user writes (model, workload, SLO objective, gates, space, budget).

Validated once at load; every problem is reported as `field.path: message`, unknown keys
are errors, YAML is loaded with `safe_load`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slotune.engine.config import DEFAULT_MODEL, EngineConfig

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")
THROUGHPUT_METRICS = ("output_tokens_per_s", "goodput_rps", "requests_per_s")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Objective(_Strict):
    """latency: minimise pXX of `metric` subject to `min_output_tokens_per_s`.
    throughput: maximise `metric` subject to pXX TTFT/TPOT limits."""

    kind: Literal["latency", "throughput"]
    metric: str = Field(description="latency: ttft|tpot|itl|e2e; throughput: output_tokens_per_s|goodput_rps|requests_per_s")
    percentile: int = Field(95, ge=50, le=99)
    ttft_limit_s: float | None = Field(None, gt=0)
    tpot_limit_s: float | None = Field(None, gt=0)
    min_output_tokens_per_s: float | None = Field(None, gt=0)
    pareto_with: list[str] = Field(default_factory=list, description="extra metrics for a multi-objective (Pareto) run, e.g. [output_tokens_per_s]")

    @model_validator(mode="after")
    def _check(self) -> "Objective":
        allowed = LATENCY_METRICS if self.kind == "latency" else THROUGHPUT_METRICS
        if self.metric not in allowed:
            raise ValueError(f"metric '{self.metric}' is not a {self.kind} metric; use one of {list(allowed)}")
        if self.metric == "goodput_rps" and self.ttft_limit_s is None and self.tpot_limit_s is None:
            raise ValueError("goodput_rps needs ttft_limit_s and/or tpot_limit_s (what counts as a good request)")
        for m in self.pareto_with:
            if m not in LATENCY_METRICS + THROUGHPUT_METRICS:
                raise ValueError(f"pareto_with: unknown metric '{m}'")
        return self

    def metric_key(self, metric: str | None = None) -> str:
        m = metric or self.metric
        return f"{m}_p{self.percentile}" if m in LATENCY_METRICS else m

    def direction(self, metric: str | None = None) -> str:
        return "minimize" if (metric or self.metric) in LATENCY_METRICS else "maximize"

    @property
    def metrics(self) -> list[str]:
        return [self.metric, *self.pareto_with]


class Budget(_Strict):
    n_trials: int = Field(12, ge=1)
    timeout_s: float | None = Field(None, gt=0, description="wall-clock cap for the whole study")
    trial_timeout_s: float = Field(600, gt=0)
    trial_memory_gb: float = Field(8.0, gt=0)
    trial_threads: int | None = Field(None, ge=1, description="CPU threads per trial process (OMP_NUM_THREADS); "
                                      "None = torch's default, one per core")
    trial_omp_wait_policy: Literal["auto", "active", "passive"] = Field(
        "auto", description="OpenMP idle threads of a trial: active (spin, as `tune serve` runs; fastest on a "
        "dedicated machine) or passive (sleep; robust when the CPU is shared); auto = passive when more than "
        "half the CPU is busy before the first trial")
    measure: Literal["served", "in_process"] = Field(
        "served", description="how a trial measures its config: served = as a client of `tune serve` sees it (the "
        "engine behind the OpenAI-compatible HTTP server, the workload replayed over loopback by a client in its own "
        "process: the numbers `tune serve` delivers); in_process = the workload replayed on the engine directly "
        "(faster trials, no HTTP or client cost: its numbers can be better than what serving delivers)")


class EarlyStop(_Strict):
    enabled: bool = True
    min_requests: int = Field(3, ge=1)
    factor: float = Field(3.0, gt=1, description="stop when the partial pXX exceeds factor x the limit")


class TuningSpec(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    model: str = DEFAULT_MODEL
    engine: dict[str, Any] = Field(default_factory=dict, description="fixed EngineConfig fields for every trial")
    workload: str | dict[str, Any] = "chat-small"
    objective: Objective
    quality_gates: list[dict[str, Any]] = Field(default_factory=list)
    search_space: str | dict[str, Any] = "latency"
    budget: Budget = Budget()
    sampler: Literal["tpe", "random", "nsga2", "gp", "grid"] = "tpe"
    seed: int = 0
    storage: str | None = Field(None, description="Optuna storage URL; default sqlite:///<output_dir>/study.db")
    mlflow_tracking_uri: str | None = Field(None, description="default sqlite:///<output_dir>/mlflow.db")
    output_dir: str | None = Field(None, description="default runs/<name>")
    early_stop: EarlyStop = EarlyStop()
    robustness_seed: int = Field(1000, description="workload seed for re-measuring the winner")

    @field_validator("engine")
    @classmethod
    def _engine_ok(cls, v: dict[str, Any]) -> dict[str, Any]:
        EngineConfig.model_validate(v)
        return v

    @field_validator("workload")
    @classmethod
    def _workload_ok(cls, v):
        from slotune.tuner.workload import WorkloadSpec

        if isinstance(v, dict):
            WorkloadSpec.model_validate(v)
        return v

    @field_validator("search_space")
    @classmethod
    def _space_ok(cls, v):
        from slotune.search_spaces.schema import SearchSpace

        if isinstance(v, dict):
            SearchSpace.model_validate(v)
        return v

    @field_validator("quality_gates")
    @classmethod
    def _gates_ok(cls, v):
        from slotune.evals.gates import GateSpec

        for g in v:
            GateSpec.model_validate(g)
        return v

    @model_validator(mode="after")
    def _check(self) -> "TuningSpec":
        if self.sampler == "grid":
            self.space().grid()  # raises for float knobs without a step
        if self.objective.pareto_with and self.sampler not in ("nsga2", "tpe", "random", "gp"):
            raise ValueError(f"sampler '{self.sampler}' cannot run a multi-objective study")
        return self

    # --- resolution ------------------------------------------------------------------------
    _base_dir: Path | None = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TuningSpec":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"spec file not found: {path}")
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping at the top level")
        spec = cls.model_validate(data)
        spec._base_dir = path.parent
        return spec

    def _resolve(self, ref: Any) -> Any:
        if isinstance(ref, str) and self._base_dir is not None and (self._base_dir / ref).exists():
            return self._base_dir / ref
        return ref

    def base_config(self) -> EngineConfig:
        return EngineConfig.model_validate({**self.engine, "model": self.model})

    def workload_spec(self):
        from slotune.tuner.workload import WorkloadSpec

        return WorkloadSpec.load(self._resolve(self.workload))

    def space(self):
        from slotune.search_spaces.schema import SearchSpace

        return SearchSpace.load(self._resolve(self.search_space))

    def gates(self):
        from slotune.evals.gates import GateSpec

        return [GateSpec.model_validate(g) for g in self.quality_gates]

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
    space, wl = spec.space(), spec.workload_spec()
    d = spec.model_dump(mode="json")
    d["workload"] = wl.model_dump(mode="json", exclude_none=True)
    d["search_space"] = space.model_dump(mode="json", exclude_none=True)
    d["output_dir"] = str(spec.resolved_output_dir())
    d["storage"] = spec.resolved_storage()
    d["mlflow_tracking_uri"] = spec.resolved_tracking_uri()
    d["engine"] = spec.base_config().model_dump(mode="json", exclude_defaults=True)
    return d


def validate_command(spec: Path) -> TuningSpec:
    """`tune validate`: load and check SPEC, then print what it resolves to.

    Args:
        spec: path of the tuning spec YAML.

    Returns:
        The validated TuningSpec. Raises pydantic.ValidationError / ValueError /
        FileNotFoundError for bad input (the CLI formats them as `field: message` lines).
    """
    from rich.console import Console
    from rich.syntax import Syntax

    s = TuningSpec.from_yaml(spec)
    space, wl = s.space(), s.workload_spec()
    obj = s.objective
    c = Console()
    c.print(f"[green]ok[/green] {spec}: study '{s.name}', {obj.kind} objective {obj.direction()} {obj.metric_key()}"
            + (f" (Pareto with {', '.join(obj.metric_key(m) for m in obj.pareto_with)})" if obj.pareto_with else ""),
            highlight=False)
    c.print(f"  workload: {wl.name} ({wl.arrivals}, {wl.num_requests} requests); search space: {space.name} "
            f"({len(space.knobs)} knobs); gates: {len(s.quality_gates)}; sampler: {s.sampler}; "
            f"budget: {s.budget.n_trials} trials, measured {s.budget.measure.replace('_', ' ')}", highlight=False)
    c.print(Syntax(yaml.safe_dump(resolved_dict(s), sort_keys=False), "yaml", theme="ansi_dark", background_color="default"))
    return s
