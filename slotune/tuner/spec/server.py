"""An external server as the thing a study tunes: the spec's `server:` section and one trial's launch.

`ServerSection` is what the user writes (the engine, its binary, the knob values every trial
keeps); `ServerConfig` is one launch: those with the model and the searched knob values on top.
It offers what the tuner asks of a config (`with_updates`, `value_at`, `model_dump`), so the search,
the confirmation and best.yaml handle it as they handle the bundled engine's EngineConfig.
`parse_config` tells the two apart in stored JSON.
"""

from __future__ import annotations

import functools
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator, model_validator

from slotune.engine.config import EngineConfig, StrictModel
from slotune.engine.paths import resolve_model_path
from slotune.tuner.spec.engines import EngineDescription, Value, load_engine

MODEL_KNOB = "model"  # a search space knob choosing the weights file among server.models
SERVER_KNOB = "server"  # a shoot-out's knob choosing among its servers (slotune/tuner/spec/shootout.py)


@functools.lru_cache(maxsize=16)
def engine_description(engine: str) -> EngineDescription:
    """`load_engine`, read once per process (every trial config asks for it)."""
    return load_engine(engine)


class Launch(StrictModel):
    """An engine, its binary and knob values: what a spec's section and one launch share."""

    engine: str = Field(min_length=1, description="a built-in engine (llama-server) or an engine file")
    binary: str | None = Field(None, description="the executable; default: the engine file's, looked up on PATH")
    knobs: dict[str, Value] = Field(default_factory=dict, description="knob values every trial keeps")

    @field_validator("engine")
    @classmethod
    def _engine_known(cls, v: str) -> str:
        engine_description(v)  # SpecError (a ValueError) naming the built-in engines
        return v

    @model_validator(mode="after")
    def _knobs_ok(self) -> Launch:
        problems = self.description().check_values(self.knobs)
        if problems:
            raise ValueError("knobs: " + "; ".join(problems))
        return self

    def description(self) -> EngineDescription:
        return engine_description(self.engine)

    def resolved_binary(self) -> str | None:
        """The executable's path: on PATH, else beside this Python (a virtual environment's scripts,
        where `tune` is); None when it is not there."""
        name = self.binary or self.description().binary
        if "/" in name:
            return name if Path(name).is_file() else None
        return shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))


class ServerSection(Launch):
    """The spec's `server:`: launch this engine's server for every trial instead of the bundled engine."""

    models: list[str] = Field(
        default_factory=list,
        description="more weights files the study chooses among; the spec's model is the default's",
    )


def is_launch(data: dict[str, Any]) -> bool:
    """Does this mapping (a best.yaml, a serving config) hold an external server's launch?"""
    return isinstance(data.get("engine"), str) and "knobs" in data


class ServerConfig(Launch):
    """One launch of an external server: a trial's config."""

    model: str = Field(min_length=1, description="the weights the server loads: a bundled name or a file")
    name: str | None = Field(None, description="its name among a shoot-out's servers")

    def with_updates(self, updates: dict[str, Any]) -> ServerConfig:
        """Copy with these knob values (and `model`, the weights) on top, validated (ValueError naming
        each problem). A value None leaves the knob's flag off: the engine's own default."""
        knobs = {**self.knobs, **{k: v for k, v in updates.items() if k != MODEL_KNOB}}
        model = updates.get(MODEL_KNOB, self.model)
        knobs = {k: v for k, v in knobs.items() if v is not None}
        return ServerConfig.model_validate({**self.model_dump(), "model": model, "knobs": knobs})

    def value_at(self, name: str) -> Value | None:
        """The knob's value at launch: set here, else the engine's own default (None: unknown). In a
        shoot-out, `server` is this launch's name and `<name>.<knob>` its knobs (others' are None)."""
        if name == SERVER_KNOB and self.name is not None:
            return self.name
        if self.name is not None and "." in name:
            prefix, _, name = name.partition(".")
            if prefix != self.name:
                return None
        if name == MODEL_KNOB:
            return self.model
        return self.knobs.get(name, self.description().knobs[name].default)

    def slots(self) -> int:
        """Requests it serves at once (the engine file's `slots` knob, or its default), the scale of a
        load sweep; 1 when the engine file does not say."""
        knob = self.description().slots
        value = self.value_at(knob) if knob else None
        return value if isinstance(value, int) and not isinstance(value, bool) else 1

    def model_file(self) -> str:
        """The weights file (a bundled name resolved to the installed GGUF; else as given)."""
        try:
            return str(resolve_model_path(self.model))
        except FileNotFoundError:
            return self.model

    def argv(self, port: int = 8080, host: str = "127.0.0.1") -> list[str]:
        """The launch command, the model resolved to its file."""
        binary = self.resolved_binary() or self.binary or self.description().binary
        return self.description().argv(self.knobs, binary=binary, model=self.model_file(), port=port, host=host)

    def to_yaml(self) -> str:
        """As best.yaml holds it: the launch command as a comment, then this config."""
        return f"# launch: {shlex.join(self.argv())}\n" + yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def knob_names(self) -> list[str]:
        """The knobs a search space may name: the weights (`model`) and the engine's knobs passed to it
        directly, not computed."""
        return [MODEL_KNOB] + [n for n, k in self.description().knobs.items() if k.value is None]


TrialConfig = EngineConfig | ServerConfig


def parse_config(data: dict[str, Any]) -> TrialConfig:
    """A trial's stored config (JSON) as its object: a ServerConfig when it names a server engine."""
    if "knobs" in data and "engine" in data:
        return ServerConfig.model_validate(data)
    return EngineConfig.model_validate(data)
