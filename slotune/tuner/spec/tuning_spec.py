"""TuningSpec: the one YAML file a user writes (model, workload, SLO objective, gates, space, budget).

Validated and resolved once, at load (slotune/tuner/spec/yaml_reader.py reads the file): every problem is
reported as `field.path: message`, and `workload`, `search_space` and `quality_gates` become objects,
whatever the user wrote (a built-in name, a file or the mapping), so the rest of the code never sees
names. Relative paths resolve against the spec file's folder, so a spec means the same from any
working directory. Checks that need the file system or the model: slotune/tuner/spec/preflight.py.
"""

from __future__ import annotations

import contextlib
import math
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator, model_validator
from slotune.engine.config import DEFAULT_MODEL, EngineConfig, StrictModel
from slotune.evals.gate_spec import GateSpec
from slotune.evals.tasks import data_dir as tasks_data_dir
from slotune.search_spaces.schema import SearchSpace, builtin_spaces
from slotune.tuner.spec import server_fit
from slotune.tuner.spec.engines import engine_ref
from slotune.tuner.spec.sections import Budget, Confirm, Cost, EarlyStop, ObjectiveSpec, Screening, Sweep
from slotune.tuner.spec.server import ServerConfig, ServerSection, TrialConfig, engine_description
from slotune.tuner.spec.shootout import Shootout, ShootoutServer, check_servers, shootout_space
from slotune.tuner.spec.slo import COST_METRICS
from slotune.tuner.spec.workload_spec import (
    MAX_SEED,
    WorkloadSpec,
    builtin_workloads,
    resolve_trace_path,
)
from slotune.tuner.spec.yaml_reader import (
    SpecError,
    check_storage_url,
    load_yaml_mapping,
    parse_yaml,
    resolve_path,
    resolve_ref,
)


class TuningSpec(StrictModel):
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
    server: ServerSection | None = Field(
        None,
        description="launch this engine's server for every trial (llama-server) instead of the bundled engine",
    )
    servers: list[ShootoutServer] | None = Field(
        None,
        description="a shoot-out: these servers searched in one study under one SLO and set of gates; "
        "the first is the default",
    )
    workload: WorkloadSpec = Field(
        "chat-small",
        validate_default=True,
        description="a built-in workload name, a "
        "YAML file (relative to the spec's folder) or the workload itself; resolved at load",
    )
    objective: ObjectiveSpec
    quality_gates: list[GateSpec] = Field(default_factory=list)
    search_space: SearchSpace = Field(
        "latency",
        validate_default=True,
        description="a built-in search space name, a YAML file or the space itself; resolved at load",
    )
    budget: Budget = Budget()
    confirm: Confirm = Confirm()
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
        description="the first fresh workload seed of the winner's confirmation (`confirm`); "
        "it uses this one and those after it",
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
        return resolve_path(v, _base_dir(info), name_ok=True)

    @field_validator("servers", mode="before")
    @classmethod
    def _servers_ok(cls, v: Any, info: ValidationInfo) -> Any:
        """Each server's paths as `server:`'s, and its search space loaded (a name, a file, a mapping)."""
        if not isinstance(v, list):
            return v
        out = []
        for entry in v:
            if isinstance(entry, dict):
                entry = cls._server_paths(entry, info)
                if "search_space" in entry:
                    entry["search_space"] = cls._space_ok(entry["search_space"], info)
            out.append(entry)
        return out

    @field_validator("servers")
    @classmethod
    def _servers_fit(cls, v: list[ShootoutServer] | None) -> list[ShootoutServer] | None:
        if v is not None:
            check_servers(v)
        return v

    @field_validator("server", mode="before")
    @classmethod
    def _server_paths(cls, v: Any, info: ValidationInfo) -> Any:
        """An engine file and the weights files, relative to the spec's folder."""
        if not isinstance(v, dict):
            return v
        base = _base_dir(info)
        v = {**v, "engine": engine_ref(v.get("engine"), base)}
        if isinstance(v.get("models"), list):
            v["models"] = [resolve_path(m, base, name_ok=True) if isinstance(m, str) else m for m in v["models"]]
        knobs = v.get("knobs")
        if isinstance(knobs, dict) and isinstance(v["engine"], str):
            with contextlib.suppress(ValueError):  # an unknown engine: the field's own check says so
                files = {k for k, d in engine_description(v["engine"]).knobs.items() if d.type == "path"}
                v["knobs"] = {
                    k: resolve_path(x, base) if k in files and isinstance(x, str) else x for k, x in knobs.items()
                }
        return v

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
            v = {**v, "speculative": {**spec, "draft_model": resolve_path(spec["draft_model"], _base_dir(info))}}
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
        if isinstance(v, dict) and "engine" in v:
            v = {**v, "engine": engine_ref(v["engine"], _base_dir(info))}
        return _load_part(SearchSpace, v, info, builtin_spaces(), "search space")

    @field_validator("search_space", mode="wrap")
    @classmethod
    def _shootout_space(cls, v, handler, info: ValidationInfo) -> SearchSpace:
        """A shoot-out's space is its servers' spaces, assembled (a dumped spec holds it already)."""
        servers = (info.data or {}).get("servers")
        if not servers:
            return handler(v)
        space = shootout_space(servers)
        if v != "latency" and v != space.model_dump(mode="json", exclude_none=True):
            raise ValueError("with servers: each server names its own search_space; remove this one")
        return space

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
            if gate.task is not None:  # an lm-eval task's metric must be one it reports
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
        return None if v is None else resolve_path(v, _base_dir(info))

    @field_validator("storage", "mlflow_tracking_uri")
    @classmethod
    def _url_ok(cls, v, info: ValidationInfo):
        if v is None:
            return v
        if info.field_name == "mlflow_tracking_uri" and not v.startswith("sqlite:"):
            return v  # MLflow also takes http(s)://, file: and other stores; only sqlite paths are resolved here
        return check_storage_url(v, _base_dir(info))

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
        server_fit.check(self)
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

    @property
    def is_external(self) -> bool:
        """Does every trial launch a server (`server:` or a shoot-out's `servers:`)?"""
        return self.server is not None or bool(self.servers)

    def base_config(self) -> TrialConfig:
        """The default config, every trial's before its searched values: the bundled engine's, the
        server's launch, or the first of a shoot-out's servers."""
        if self.servers:
            return self.search_base().default
        if self.server is not None:
            return ServerConfig(**self.server.model_dump(exclude={"models"}), model=self.model)
        return EngineConfig.model_validate({**self.engine, "model": self.model})

    def search_base(self) -> TrialConfig | Shootout:
        """What a trial's params are applied to (`with_updates`): the base config, or in a shoot-out
        every server's launch."""
        return Shootout(self.servers, self.model) if self.servers else self.base_config()

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
    if not spec.is_external:
        d["engine"] = spec.base_config().model_dump(mode="json", exclude_defaults=True)
    return d


# --- validation helpers --------------------------------------------------------------------------
def _base_dir(info: ValidationInfo) -> Path | None:
    """The spec file's folder (`from_yaml`), or None for a spec built in code (paths stay as given)."""
    return (info.context or {}).get("base_dir")


def _load_part(model, value: Any, info: ValidationInfo, builtins: dict[str, Path], what: str):
    """A workload or search space as the spec gives it: the object, its mapping, or a reference (a file
    next to the spec, a built-in name) whose file's own problems are named by its path."""
    if isinstance(value, model):
        return value
    if isinstance(value, dict):
        return _validate_nested(model, value)
    if not isinstance(value, str):
        raise ValueError(f"a built-in {what} name, a {what} file or a {what} mapping")
    return model.load(resolve_ref(value, _base_dir(info), builtins))


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


def _task_metrics(task: str) -> list[str]:
    """The metrics a bundled lm-eval task reports (its template's metric_list)."""
    tmpl = tasks_data_dir() / task.removeprefix("slotune_") / "task.yaml.tmpl"
    data = parse_yaml(tmpl.read_text(), str(tmpl))
    return [m["metric"] for m in data.get("metric_list") or []]
