"""Search spaces as data: knobs (EngineConfig field paths) mapped onto Optuna distributions.

A knob is sampled define-by-run, only when its `when` condition holds, so a conditional knob
(e.g. `speculative.num_speculative_tokens` only when a draft is used) never pollutes the
sampler's model with meaningless values. `forbidden` lists combinations that are pruned
before any engine is built.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator


class Knob(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="dotted EngineConfig field, e.g. 'kernels.decode_attention.block_n'")
    type: Literal["categorical", "int", "float"]
    choices: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    when: dict[str, list[Any]] = Field(default_factory=dict, description="sample only if these fields take these values")

    @model_validator(mode="after")
    def _check(self) -> "Knob":
        if self.type == "categorical":
            if not self.choices:
                raise ValueError(f"knob '{self.name}': categorical needs a non-empty 'choices' list")
        elif self.low is None or self.high is None or self.low > self.high:
            raise ValueError(f"knob '{self.name}': {self.type} needs low <= high")
        return self

    def distribution(self):
        import optuna.distributions as d

        if self.type == "categorical":
            return d.CategoricalDistribution(self.choices)
        if self.type == "int":
            return d.IntDistribution(int(self.low), int(self.high), log=self.log, step=int(self.step or 1))
        return d.FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def grid_values(self) -> list[Any]:
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            step = int(self.step or 1)
            return list(range(int(self.low), int(self.high) + 1, step))
        raise ValueError(f"knob '{self.name}': a float knob has no grid; give it a step or make it categorical")


class SearchSpace(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    description: str = ""
    knobs: list[Knob]
    forbidden: list[dict[str, list[Any]]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check(self) -> "SearchSpace":
        from slotune.engine.config import EngineConfig

        names = [k.name for k in self.knobs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"knobs declared twice: {sorted(dup)}")
        base = EngineConfig()
        for k in self.knobs:
            probe = k.choices[0] if k.type == "categorical" else (int(k.low) if k.type == "int" else k.low)
            try:
                base.with_updates({k.name: probe})
            except ValueError as exc:
                raise ValueError(f"knob '{k.name}': not a valid EngineConfig field/value ({str(exc).splitlines()[0]})") from None
            for cond in k.when:
                if cond not in names:
                    raise ValueError(f"knob '{k.name}': condition on '{cond}', which is not a knob of this space")
        return self

    @classmethod
    def load(cls, ref: "str | Path | dict | SearchSpace") -> "SearchSpace":
        """From a mapping, a YAML path, or a built-in name (latency, throughput, low-memory)."""
        if isinstance(ref, SearchSpace):
            return ref
        if isinstance(ref, dict):
            return cls.model_validate(ref)
        path = Path(ref)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.exists():
                raise FileNotFoundError(f"search space file not found: {path}")
            return cls.model_validate(yaml.safe_load(path.read_text()))
        names = builtin_spaces()
        if str(ref) not in names:
            raise ValueError(f"unknown search space '{ref}': not a file, and not a built-in ({', '.join(sorted(names))})")
        return cls.model_validate(yaml.safe_load(names[str(ref)].read_text()))

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
        return {k.name: k.grid_values() for k in self.knobs}


def _suggest(trial, k: Knob) -> Any:
    if k.type == "categorical":
        return trial.suggest_categorical(k.name, k.choices)
    if k.type == "int":
        return trial.suggest_int(k.name, int(k.low), int(k.high), step=int(k.step or 1), log=k.log)
    return trial.suggest_float(k.name, k.low, k.high, step=k.step, log=k.log)


def builtin_spaces() -> dict[str, Path]:
    root = resources.files("slotune.search_spaces")
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}
