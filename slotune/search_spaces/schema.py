"""Search spaces as data: knobs (EngineConfig field paths) mapped onto Optuna distributions.

A knob is sampled define-by-run, only when its `when` condition holds, so a conditional knob
(e.g. `speculative.num_speculative_tokens` only when a draft is used) never pollutes the
sampler's model with meaningless values. `forbidden` lists combinations that are pruned
before any engine is built. `starts` are known-good corners, each with the reasoning behind it,
enqueued right after the reference configs for the objective kinds it names, so the sampler
begins from what an expert would try first instead of from random points.

Every value a knob can take is checked against EngineConfig when the space is loaded (every
choice, both bounds, and every value of a small int range), so a space that validates never
samples a config the engine rejects on its own (combinations of knobs may still be invalid:
those trials fail and are recorded).
"""

from __future__ import annotations

import math
import typing
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from slotune.engine.config import EngineConfig
from slotune.tuner.spec.engines import engine_ref
from slotune.tuner.spec.server import ServerConfig, TrialConfig
from slotune.tuner.spec.slo import METRICS_OF_KIND
from slotune.tuner.spec.yaml_reader import SpecError, load_yaml_mapping

MAX_GRID_VALUES = 10_000  # values of one knob in a grid
MAX_GRID_SIZE = 1_000_000  # configs in a whole grid (Optuna's GridSampler lists them all)
_MAX_PROBES = 1024  # an int knob with at most this many values has every value checked


def _scalar(v: Any) -> Any:
    """Optuna's categorical values: None, bool, int, float (finite) or str."""
    if v is not None and type(v) not in (bool, int, float, str):
        raise ValueError(f"a value must be text, a number, true/false or null, got {type(v).__name__} {v!r}")
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{v} is not a usable value (NaN and inf are not accepted)")
    return v


Scalar = Annotated[Any, AfterValidator(_scalar)]


class Knob(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(
        description="a dotted EngineConfig field, e.g. 'kernels.decode_attention.block_n', or a server engine's knob"
    )
    type: Literal["categorical", "int", "float"]
    choices: list[Scalar] | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = Field(None, gt=0)
    log: bool = False
    when: dict[str, list[Scalar]] = Field(
        default_factory=dict, description="sample only if these fields take these values"
    )

    @model_validator(mode="after")
    def _check(self) -> "Knob":
        where = f"knob '{self.name}'"
        if self.type == "categorical":
            if not self.choices:
                raise ValueError(f"{where}: categorical needs a non-empty 'choices' list")
            extra = [f for f in ("low", "high", "step") if getattr(self, f) is not None] + ["log"] * self.log
            if extra:
                raise ValueError(
                    f"{where}: a categorical knob takes 'choices' only; remove {extra} (for int/float knobs)"
                )
            dup = sorted({repr(c) for i, c in enumerate(self.choices) if _index(self.choices, c) != i})
            if dup:
                raise ValueError(f"{where}: choices listed twice: {', '.join(dup)}")
        else:
            if self.choices is not None:
                raise ValueError(f"{where}: an {self.type} knob takes low/high (and step or log), not 'choices'")
            if self.low is None or self.high is None or self.low > self.high:
                raise ValueError(f"{where}: {self.type} needs low <= high")
            if self.type == "int":
                bad = [
                    f"{f}={getattr(self, f)}"
                    for f in ("low", "high", "step")
                    if getattr(self, f) is not None and not float(getattr(self, f)).is_integer()
                ]
                if bad:
                    raise ValueError(f"{where}: an int knob needs whole numbers ({', '.join(bad)}); use type float")
            if self.step is not None:
                n = (self.high - self.low) / self.step
                if abs(n - round(n)) > 1e-9 * max(1.0, abs(n)):
                    raise ValueError(
                        f"{where}: high - low ({self.high - self.low:g}) is not a multiple of step "
                        f"({self.step:g}); Optuna would lower high to fit"
                    )
            if self.log:
                if self.low <= 0:
                    raise ValueError(f"{where}: log scale needs low > 0, got {self.low}")
                if self.step is not None and not (self.type == "int" and self.step == 1):
                    raise ValueError(
                        f"{where}: log and step cannot be combined (Optuna samples a log scale continuously); drop one"
                    )
        for field, vals in self.when.items():
            if not vals:
                raise ValueError(f"{where}: when.{field} is an empty list, so the knob would never be sampled")
        return self

    @property
    def num_values(self) -> int | None:
        """How many values the knob can take (None for a continuous float knob)."""
        if self.type == "categorical":
            return len(self.choices)
        if self.type == "int":
            return int(self.high - self.low) // int(self.step or 1) + 1
        return None

    def can_take(self, value: Any) -> bool:
        """Whether a sample of this knob can equal `value` (for `when` and `forbidden`)."""
        if self.type == "categorical":
            return _index(self.choices, value) >= 0
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            return False
        if self.type == "int":
            return float(value).is_integer() and (value - self.low) % int(self.step or 1) == 0
        return True

    def distribution(self):
        import optuna.distributions as d

        if self.type == "categorical":
            return d.CategoricalDistribution(self.choices)
        if self.type == "int":
            return d.IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return d.FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def grid_values(self) -> list[Any]:
        """The knob's values in a grid; refuses knobs a grid cannot list as the other samplers sample them."""
        if self.type == "float":
            raise ValueError(f"knob '{self.name}': a float knob has no grid; give it a step or make it categorical")
        if self.when:
            conds = ", ".join(f"{f} in {v}" for f, v in self.when.items())
            raise ValueError(
                f"knob '{self.name}': sampled only when {conds}, but a grid sets every knob in every config "
                f"(Optuna's GridSampler has no conditional grids); use sampler: tpe or random, or drop its `when`"
            )
        if self.log:
            doubling = [int(self.low) * 2**i for i in range(64) if int(self.low) * 2**i <= int(self.high)]
            choices = doubling + ([int(self.high)] if doubling[-1] != int(self.high) else [])
            raise ValueError(
                f"knob '{self.name}': a log-scaled range has no grid (a grid would list every value from "
                f"{int(self.low)} to {int(self.high)}); make it categorical, e.g. choices: {choices}"
            )
        if self.num_values > MAX_GRID_VALUES:
            raise ValueError(
                f"knob '{self.name}': {self.num_values} values is too many for a grid "
                f"(at most {MAX_GRID_VALUES}); use a larger step, or another sampler"
            )
        return self._values()

    def _values(self) -> list[Any]:
        if self.type == "categorical":
            return list(self.choices)
        return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))

    def probe_values(self) -> list[Any]:
        """The values checked against EngineConfig: every choice; both bounds, every value of a small
        int range, and a fractional midpoint for a float knob (which an int field refuses)."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            if self.num_values <= _MAX_PROBES:
                return self._values()
            return [int(self.low), int(self.high)]
        mid = (self.low + self.high) / 2
        return [self.low, self.high] + ([mid] if not mid.is_integer() else [])


def _index(values: list[Any], v: Any) -> int:
    """Position of `v` in `values` by type and value (True is not 1, 1 is not 1.0 here), else -1."""
    for i, c in enumerate(values):
        if type(c) is type(v) and c == v:
            return i
    return -1


_UnionType = type(int | None)


def _field_type(name: str) -> Any:
    """The annotation of a dotted EngineConfig field, or None if there is no such field."""
    model: Any = EngineConfig
    ann = None
    for part in name.split("."):
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        ann = fields[part].annotation
        model = ann
    return ann


def _is_int_field(ann: Any) -> bool:
    """int, int | None, or a Literal of ints only."""
    args = (
        [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, _UnionType)
        else [ann]
    )
    if len(args) != 1:
        return False
    a = args[0]
    if typing.get_origin(a) is Literal:
        return all(type(v) is int for v in typing.get_args(a))
    return a is int


class Start(BaseModel):
    """A starting point: the base config with `params` changed, measured before the sampler's own."""

    @model_validator(mode="after")
    def _check_metrics(self) -> "Start":
        allowed = [m for kind in self.objectives for m in METRICS_OF_KIND[kind]]
        wrong = [m for m in self.metrics if m not in allowed]
        if wrong:
            raise ValueError(
                f"start '{self.name}': metrics {wrong} are not metrics of its objectives "
                f"{self.objectives}; use some of {allowed}"
            )
        return self

    def suits(self, kind: str, metric: str) -> bool:
        """Whether this corner is a good start for an objective of this kind and metric."""
        return kind in self.objectives and (not self.metrics or metric in self.metrics)

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=64)
    why: str = Field(min_length=1, description="the reasoning: why an expert would try this corner first")
    objectives: list[Literal["latency", "throughput", "cost"]] = Field(
        default_factory=lambda: ["latency", "throughput", "cost"],
        min_length=1,
        description="the objective kinds this corner is a good start for",
    )
    metrics: list[str] = Field(
        default_factory=list,
        description="the objective metrics (ttft, tpot, goodput_rps, ...) "
        "it is a good start for, within those kinds; empty = every metric",
    )
    params: dict[str, Scalar] = Field(min_length=1, description="knob values; knobs not named keep the base config's")
    # Each repair is enqueued when the one before it missed (the tuner's StartRepairs); say [{max_num_seqs: 2}]
    # for a batch-1 start whose queue may push TTFT past its limit.
    then: list[dict[str, Scalar]] = Field(
        default_factory=list,
        description="repairs tried in turn while this start misses an SLO limit: `params` with these values on top",
    )

    def rung(self, i: int) -> dict[str, Scalar]:
        """The params of the i-th try: 0 is the start itself, i >= 1 its (i-1)-th repair in `then`."""
        return dict(self.params) if i == 0 else {**self.params, **self.then[i - 1]}


class SearchSpace(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = "custom"
    description: str = ""
    engine: str | None = Field(
        None,
        description="the server engine whose knobs this space names (a spec's server.engine); none: the bundled engine",
    )
    knobs: list[Knob]
    forbidden: list[dict[str, list[Scalar]]] = Field(default_factory=list)
    starts: list[Start] = Field(default_factory=list, description="known-good corners, enqueued after the references")

    @model_validator(mode="after")
    def _check(self) -> "SearchSpace":
        names = [k.name for k in self.knobs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"knobs declared twice: {sorted(dup)}")
        by_name = {k.name: k for k in self.knobs}
        base = self.base_config()
        for i, k in enumerate(self.knobs):
            self._check_knob(k, base)
            for cond, vals in k.when.items():
                if cond not in by_name:
                    raise ValueError(f"knob '{k.name}': condition on '{cond}', which is not a knob of this space")
                if cond == k.name:
                    raise ValueError(f"knob '{k.name}': a condition on itself")
                if names.index(cond) > i:
                    raise ValueError(
                        f"knob '{k.name}': condition on '{cond}', which is declared after it (knobs are "
                        f"sampled in order): move '{cond}' above '{k.name}'"
                    )
                self._check_values(f"knob '{k.name}': when.{cond}", by_name[cond], vals)
        for j, rule in enumerate(self.forbidden):
            if not rule:
                raise ValueError(f"forbidden[{j}]: an empty rule would forbid every config")
            for field, vals in rule.items():
                if field not in by_name:
                    raise ValueError(
                        f"forbidden[{j}]: '{field}' is not a knob of this space (knobs: {', '.join(names)})"
                    )
                if not vals:
                    raise ValueError(
                        f"forbidden[{j}].{field}: an empty list never matches; remove the rule or list values"
                    )
                self._check_values(f"forbidden[{j}].{field}", by_name[field], vals)
        for j, start in enumerate(self.starts):
            where = f"starts[{j}] '{start.name}'"
            if start.name in [s.name for s in self.starts[:j]]:
                raise ValueError(f"{where}: name used twice")
            for i in range(len(start.then) + 1):
                if i and not start.then[i - 1]:
                    raise ValueError(
                        f"{where}.then[{i - 1}]: an empty repair changes nothing; name the knobs it changes"
                    )
                at = where if i == 0 else f"{where}.then[{i - 1}]"
                self._check_start(at, f"{where}.params" if i == 0 else at, start.rung(i), by_name, base)
        return self

    def base_config(self) -> TrialConfig:
        """The config this space's values are checked on: the bundled engine's defaults, or a launch of
        its server engine with nothing set."""
        if self.engine is None:
            return EngineConfig()
        return ServerConfig(engine=self.engine, model="-")

    def _check_knob(self, k: Knob, base: TrialConfig) -> None:
        """The knob names a field of the config, and every value it can take is one the config takes."""
        what = "EngineConfig field/value" if isinstance(base, EngineConfig) else f"{self.engine} knob/value"
        if isinstance(base, ServerConfig):
            names = base.knob_names()
            if k.name not in names:
                raise ValueError(f"knob '{k.name}': not a {self.engine} knob (its knobs: {', '.join(names)})")
            knob = base.description().knobs.get(k.name)  # None: the weights file (`model`)
            is_int = knob is not None and knob.type == "int"
        else:
            ann = _field_type(k.name)
            if ann is None:
                raise ValueError(f"knob '{k.name}': not a valid {what} (no field '{k.name}')")
            is_int = _is_int_field(ann)
        if k.type == "float" and is_int:
            raise ValueError(
                f"knob '{k.name}': not a valid {what}: a float knob on a whole-number field; use type int (or categorical)"
            )
        for value in k.probe_values():
            try:
                if isinstance(base, ServerConfig) and knob is not None:  # its rules need the spec's knobs too
                    problems = [] if value is None else base.description().check_values({k.name: value}, rules=False)
                    if problems:
                        raise ValueError(problems[0])
                else:
                    base.with_updates({k.name: value})
            except ValueError as exc:
                raise ValueError(f"knob '{k.name}': not a valid {what}: {value!r} ({_first_problem(exc)})") from None

    def _check_start(
        self, where: str, values_at: str, params: dict[str, Any], by_name: dict[str, Knob], base: TrialConfig
    ) -> None:
        """A start's params (or one of its repairs, over them): knobs of this space, values they can
        take (a bad one named as `values_at`.knob), conditions met, no forbidden combination, a valid
        EngineConfig."""
        for field, value in params.items():
            if field not in by_name:
                raise ValueError(f"{where}: '{field}' is not a knob of this space (knobs: {', '.join(by_name)})")
            self._check_values(f"{values_at}.{field}", by_name[field], [value])
            for cond, vals in by_name[field].when.items():
                if params.get(cond, base.value_at(cond)) not in vals:
                    raise ValueError(f"{where}: '{field}' is sampled only when {cond} is one of {vals}; set {cond}")
        reason = self.forbidden_reason(params)
        if reason is not None:
            raise ValueError(f"{where}: a {reason}")
        try:
            base.with_updates(params)
        except ValueError as exc:
            what = "EngineConfig" if self.engine is None else f"{self.engine} launch"
            raise ValueError(f"{where}: not a valid {what}: {_first_problem(exc)}") from None

    @staticmethod
    def _check_values(where: str, knob: Knob, values: list[Any]) -> None:
        bad = [v for v in values if not knob.can_take(v)]
        if bad:
            can = knob.choices if knob.type == "categorical" else f"{knob.type} in [{knob.low:g}, {knob.high:g}]"
            raise ValueError(f"{where}: {', '.join(map(repr, bad))} is not a value knob '{knob.name}' can take ({can})")

    @classmethod
    def load(cls, ref: "str | Path | dict | SearchSpace") -> "SearchSpace":
        """From a mapping, a YAML path, or a built-in name (latency, throughput, low-memory).

        Raises SpecError (naming the file) for a file's problems, MissingFileError if it is absent.
        """
        if isinstance(ref, SearchSpace):
            return ref
        if isinstance(ref, dict):
            return cls.model_validate(ref)
        path = Path(ref)
        if not (path.suffix in (".yaml", ".yml") or path.exists()):
            names = builtin_spaces()
            if str(ref) not in names:
                raise ValueError(
                    f"unknown search space '{ref}': not a file, and not a built-in ({', '.join(sorted(names))})"
                )
            path = names[str(ref)]
        data = load_yaml_mapping(path, "search space file")
        if "engine" in data:  # an engine file is relative to this one
            data = {**data, "engine": engine_ref(data["engine"], Path(path).parent)}
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError.from_validation(exc, path) from None

    def sample(self, trial) -> dict[str, Any]:
        """Define-by-run sampling honoring `when` conditions (knobs are declared in order)."""
        params: dict[str, Any] = {}
        for k in self.knobs:
            if all(params.get(f) in vals for f, vals in k.when.items()):
                params[k.name] = _suggest(trial, k)
        return params

    def forbidden_reason(self, params: dict[str, Any]) -> str | None:
        for rule in self.forbidden:
            if all(params.get(f) in vals for f, vals in rule.items()):
                return "forbidden combination: " + ", ".join(f"{f} in {v}" for f, v in rule.items())
        return None

    def grid(self) -> dict[str, list[Any]]:
        """Every knob's values, for Optuna's GridSampler; refuses a grid too large to list."""
        grid = {k.name: k.grid_values() for k in self.knobs}
        size = math.prod(len(v) for v in grid.values())
        if size > MAX_GRID_SIZE:
            raise ValueError(
                f"the grid has {size} configs (at most {MAX_GRID_SIZE}); use fewer values or another sampler"
            )
        return grid


def _first_problem(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return err["msg"].removeprefix("Value error, ")
    return str(exc).splitlines()[0]


def _suggest(trial, k: Knob) -> Any:
    if k.type == "categorical":
        return trial.suggest_categorical(k.name, k.choices)
    if k.type == "int":
        return trial.suggest_int(k.name, int(k.low), int(k.high), step=int(k.step or 1), log=k.log)
    return trial.suggest_float(k.name, k.low, k.high, step=k.step, log=k.log)


def builtin_spaces() -> dict[str, Path]:
    root = resources.files("slotune.search_spaces")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}
