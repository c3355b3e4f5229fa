"""Workloads as data: arrivals, prompt/output length distributions, shared prefixes; seeded.

A `WorkloadSpec` expands (slotune/tuner/workload/requests.py) into a reproducible stream of requests: the
same spec and seed give the same token ids, arrivals and output lengths on any machine. Or it
replays a recorded trace (`trace: {path: ...}`, slotune/tuner/spec/traces.py). Lengths and open-loop gaps
are stratified by default, so a seed changes which requests are long or bursty but hardly the
workload's total tokens or mean rate. Measurements: docs/design/tuner-workload.md.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)
from slotune.engine.config import StrictModel
from slotune.tuner.spec.traces import TraceSource
from slotune.tuner.spec.yaml_reader import MissingFileError, SpecError, load_yaml_mapping

BUILTIN_DIR = "workloads"
_DEFAULT_NUM_REQUESTS = 16
MAX_SEED = 2**32 - 1  # numpy's legacy RandomState (Optuna's samplers) takes seeds below 2**32
MAX_LEN = 2**24  # tokens; beyond any model's context, and far from int64 overflow in numpy's draws
STRATUM_BLOCK = 8  # stratified lengths and gaps: each block of this many covers every 1/8 of the distribution


class Fixed(StrictModel):
    kind: Literal["fixed"] = "fixed"
    value: int = Field(ge=1, le=MAX_LEN)


class Uniform(StrictModel):
    kind: Literal["uniform"] = "uniform"
    min: int = Field(ge=1, le=MAX_LEN)
    max: int = Field(ge=1, le=MAX_LEN)

    @model_validator(mode="after")
    def _check(self) -> "Uniform":
        if self.min > self.max:
            raise ValueError(f"uniform: min ({self.min}) must be <= max ({self.max})")
        return self


class LogNormal(StrictModel):
    kind: Literal["lognormal"] = "lognormal"
    mean: float = Field(gt=0, le=MAX_LEN, description="median length in tokens (exp of the underlying normal's mean)")
    sigma: float = Field(0.5, ge=0, le=10)
    min: int = Field(1, ge=1, le=MAX_LEN)
    max: int = Field(4096, ge=1, le=MAX_LEN)

    @model_validator(mode="after")
    def _check(self) -> "LogNormal":
        if self.min > self.max:
            raise ValueError(f"lognormal: min ({self.min}) must be <= max ({self.max})")
        return self


Length = Union[Fixed, Uniform, LogNormal]  # noqa: UP007


class SharedPrefix(StrictModel):
    """A common start (system prompt, retrieved context) that a share of requests begin with."""

    num_tokens: int | None = Field(None, ge=1, le=MAX_LEN, description="prefix length, taken from the corpus")
    text: str | None = Field(None, min_length=1, description="or: this exact text")
    fraction: float = Field(1.0, ge=0, le=1, description="share of requests that start with it")

    @model_validator(mode="after")
    def _check(self) -> "SharedPrefix":
        if (self.num_tokens is None) == (self.text is None):
            raise ValueError("shared_prefix: give exactly one of num_tokens or text")
        return self


def _bound(length: Length) -> int:
    return length.value if isinstance(length, Fixed) else length.max


# Fields a trace replay takes from the trace: given beside `trace: {path: ...}`, they would be ignored.
_TRACE_DECIDES = {
    "prompt_len": "its prompt lengths",
    "output_len": "its output lengths",
    "shared_prefix": "its block hash ids (the prefixes its requests shared)",
    "rate": "its arrival times",
    "duration_s": "its arrival times (pick a span with trace.window)",
    "num_requests": "its requests (cap them with trace.max_requests)",
    "length_sampling": "its lengths",
    "arrival_sampling": "its arrival times",
}


class WorkloadSpec(StrictModel):
    """What traffic a benchmark or trial replays.

    Arrivals: `closed_loop` keeps `concurrency` requests in flight; open loop (`poisson`,
    `fixed_rate`, `gamma` as vLLM's `--burstiness`, `trace`) sends each request at its arrival time.
    Stop rule: `num_requests`, `duration_s`, or whichever comes first. `trace` as a string is a
    lengths file; as a mapping (`TraceSource`) a trace replayed whole, so the fields it decides are
    refused beside it. Each rule in full: docs/design/tuner-workload.md.
    """

    name: str = "custom"
    description: str = ""
    mode: Literal["completion", "chat"] = Field(
        "completion", description="chat: prompt text goes through the model's chat template (shared prefix as system)"
    )
    arrivals: Literal["poisson", "fixed_rate", "gamma", "closed_loop", "trace"] = Field(
        "closed_loop", description="default: trace when `trace` is a mapping, else closed_loop"
    )
    rate: float | None = Field(None, gt=0, description="requests/s for poisson, fixed_rate and gamma")
    burstiness: float | None = Field(
        None,
        gt=0,
        description="gamma arrivals: the gaps' shape; 1 = Poisson, "
        "< 1 burstier, > 1 more even (CV = 1/sqrt(burstiness))",
    )
    concurrency: int = Field(4, ge=1, description="requests kept in flight for closed_loop")
    num_requests: int | None = Field(
        None,
        ge=1,
        description=f"measured requests (default {_DEFAULT_NUM_REQUESTS} "
        "unless duration_s is given; a trace: all of it)",
    )
    duration_s: float | None = Field(None, gt=0, description="stop issuing requests after this long")
    warmup_requests: int = Field(1, ge=0, description="run first, excluded from metrics")
    prompt_len: Length = Field(default_factory=lambda: Fixed(value=64), discriminator="kind")
    output_len: Length = Field(default_factory=lambda: Fixed(value=32), discriminator="kind")
    # Stratified (in a random order within each block), seeds differ in which requests are long, hardly in
    # total tokens, and so hardly in the throughput a trial measures.
    length_sampling: Literal["stratified", "independent"] = Field(
        "stratified",
        description=f"stratified: each block of {STRATUM_BLOCK} requests takes one length from each 1/{STRATUM_BLOCK} "
        "of the distribution; independent: every length drawn on its own",
    )
    # Stratified, every gap keeps the distribution asked for, bursts included, while seeds differ less
    # in the replay's mean rate (and so in a queueing-bound TTFT).
    arrival_sampling: Literal["stratified", "independent"] = Field(
        "stratified",
        description=f"poisson and gamma gaps; stratified: each block of {STRATUM_BLOCK} takes one from each "
        f"1/{STRATUM_BLOCK} of the distribution; independent: each drawn on its own",
    )
    # A lengths file has one {prompt | prompt_len, output_len} per line, cycled if shorter, under any
    # arrivals; a mapping {path, format, block_size, time_scale, window, max_requests} is a TraceSource.
    trace: str | TraceSource | None = Field(
        None,
        description="a lengths file (JSONL, replaces prompt_len/output_len), or a mapping {path, ...}: "
        "a recorded/Mooncake/Azure/BurstGPT trace to replay",
    )
    shared_prefix: SharedPrefix | None = None
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @field_validator("trace", mode="wrap")
    @classmethod
    def _trace_kind(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # A mapping is a TraceSource: its problems name trace.<field>, not each arm of the union.
        return TraceSource.model_validate(v) if isinstance(v, dict) else handler(v)

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("trace"), (dict, TraceSource)):
            return {**data, "arrivals": data.get("arrivals") or "trace"}
        if data.get("num_requests") is None and data.get("duration_s") is None:
            data = {**data, "num_requests": _DEFAULT_NUM_REQUESTS}
        return data

    @model_validator(mode="after")
    def _check(self) -> "WorkloadSpec":
        if isinstance(self.trace, TraceSource):
            self._check_trace_replay()
            return self
        if self.arrivals == "trace":
            got = "a lengths file (a string)" if self.trace else "no trace"
            raise ValueError(
                f"arrivals 'trace' replays a trace's own arrival times: give `trace` as a mapping "
                f"{{path: FILE}} (got {got})"
            )
        if self.arrivals in ("poisson", "fixed_rate", "gamma") and self.rate is None:
            raise ValueError(f"rate is required when arrivals is '{self.arrivals}' (requests per second)")
        if self.arrivals == "gamma" and self.burstiness is None:
            raise ValueError(
                "burstiness is required when arrivals is 'gamma' (the gaps' shape: 1 = Poisson, "
                "< 1 burstier, > 1 more even)"
            )
        if self.burstiness is not None and self.arrivals != "gamma":
            raise ValueError(f"burstiness applies to arrivals 'gamma' only, not '{self.arrivals}'")
        return self

    def _check_trace_replay(self) -> None:
        if self.arrivals != "trace":
            raise ValueError(
                f"arrivals '{self.arrivals}': a trace mapping replays the trace's own arrival times "
                "(arrivals 'trace', the default); for generated arrivals with traced lengths, give "
                "`trace` a lengths file (tune workload fit --empirical writes one)"
            )
        given = [k for k in _TRACE_DECIDES if k in self.model_fields_set and getattr(self, k) is not None]
        if self.burstiness is not None:
            given.append("burstiness")
        if given:
            why = "; ".join(f"{k}: the trace gives {_TRACE_DECIDES.get(k, 'its arrival times')}" for k in given)
            raise ValueError(
                f"{', '.join(given)} cannot be set beside a trace mapping ({why}); remove "
                f"{'it' if len(given) == 1 else 'them'}"
            )
        if self.mode == "chat":
            raise ValueError(
                "mode 'chat' with a trace mapping: traced prompt lengths already include the chat "
                "template, and prompts are rebuilt as token ids; use mode 'completion'"
            )

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A trace replay has no length distributions: its dump (a trial's input, validated again) leaves
        # the unused defaults out, so that it validates as what the user wrote.
        data = handler(self)
        if isinstance(self.trace, TraceSource):
            for key in ("prompt_len", "output_len", "length_sampling", "arrival_sampling"):
                data.pop(key, None)
        return data

    @property
    def is_closed_loop(self) -> bool:
        return self.arrivals == "closed_loop"

    def longest_request(self) -> int | None:
        """The most tokens one request can hold (prompt, shared prefix and output at their bounds);
        None when a trace or a prefix given as text decides it. Chat templates add a few more."""
        if self.trace is not None or (self.shared_prefix and self.shared_prefix.text):
            return None
        prefix = self.shared_prefix.num_tokens if self.shared_prefix else 0
        return _bound(self.prompt_len) + prefix + _bound(self.output_len)

    @property
    def trace_source(self) -> TraceSource | None:
        """The trace this workload replays (a `trace:` mapping), or None."""
        return self.trace if isinstance(self.trace, TraceSource) else None

    @classmethod
    def load(cls, ref: "str | Path | dict | WorkloadSpec") -> "WorkloadSpec":
        """A spec from a mapping, a YAML path, or a built-in name (chat-small, batch-mixed, shared-prefix).

        A relative trace path in a YAML file (`trace: FILE` or `trace: {path: FILE}`) is resolved
        against that file's folder, and must exist.
        """
        if isinstance(ref, WorkloadSpec):
            return ref
        if isinstance(ref, dict):
            return cls.model_validate(ref)
        path = Path(ref)
        if path.suffix in (".yaml", ".yml", ".json") or path.exists():
            base: Path | None = Path(os.path.abspath(path)).parent  # a replay may run from another directory
        else:
            names = builtin_workloads()
            if str(ref) not in names:
                raise ValueError(
                    f"unknown workload '{ref}': not a file, and not a built-in ({', '.join(sorted(names))})"
                )
            path, base = names[str(ref)], None
        data = load_yaml_mapping(path, "workload file", empty_ok=True)
        try:
            if base is not None:
                data = resolve_trace_path(data, base)
            spec = cls.model_validate(data)
            spec.check_trace_exists()
        except ValidationError as exc:
            raise SpecError.from_validation(exc, path) from None
        except SpecError as exc:
            raise exc.with_source(path) from None
        return spec

    def check_trace_exists(self) -> None:
        """Raises MissingFileError (naming the field) when the trace this workload names is absent."""
        if isinstance(self.trace, str) and not Path(self.trace).is_file():
            raise MissingFileError(f"trace file not found: {self.trace}", field="trace")
        if isinstance(self.trace, TraceSource) and not Path(self.trace.path).expanduser().exists():
            raise MissingFileError(f"trace not found: {self.trace.path}", field="trace.path")


def resolve_trace_path(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A workload mapping with its relative trace path (`trace: FILE` or `trace: {path: FILE}`) joined to
    `base`, the folder of the YAML file that holds it; values of the wrong type are left for validation."""

    def join(ref: str, field: str) -> str:
        if "\x00" in ref:
            raise SpecError("contains a NUL character", field=field)
        p = Path(ref).expanduser()
        return str(p) if p.is_absolute() else os.path.normpath(base / p)

    trace = data.get("trace")
    if isinstance(trace, str):
        return {**data, "trace": join(trace, "trace")}
    if isinstance(trace, dict) and isinstance(trace.get("path"), str):
        return {**data, "trace": {**trace, "path": join(trace["path"], "trace.path")}}
    return data


def builtin_workloads() -> dict[str, Path]:
    """Built-in workload names -> their YAML files (package data in slotune/tuner/workloads/)."""
    root = resources.files("slotune.tuner") / BUILTIN_DIR
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL trace, each checked: `output_len` and one of `prompt` (text) / `prompt_len`.

    Raises MissingFileError, or SpecError naming the line.
    """
    p = Path(path)
    if not p.is_file():
        hint = " (a directory; a recording directory replays with `trace: {path: DIR}`)" if p.is_dir() else ""
        raise MissingFileError("trace file not found" + hint, source=p)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the trace: {exc}", source=p) from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise SpecError(f"not a JSON object: {exc}", source=p, line=i) from None
        if not isinstance(row, dict):
            raise SpecError(f"each line must be a JSON object, got {type(row).__name__}", source=p, line=i)
        if "output_len" not in row or ("prompt" not in row and "prompt_len" not in row):
            hint = (
                " (this looks like a recorded or Mooncake trace: replay it with `trace: {path: FILE}`)"
                if {"arrival", "timestamp"} & row.keys()
                else ""
            )
            raise SpecError(
                f"each line needs output_len and one of prompt / prompt_len, got {sorted(row)}{hint}", source=p, line=i
            )
        for key in ("output_len", "prompt_len"):
            v = row.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LEN:
                raise SpecError(f"{key} must be a whole number of tokens in 1..{MAX_LEN}, got {v!r}", source=p, line=i)
        if "prompt" in row and (not isinstance(row["prompt"], str) or not row["prompt"]):
            raise SpecError("prompt must be non-empty text", source=p, line=i)
        rows.append(row)
    if not rows:
        raise SpecError("the trace is empty", source=p)
    return rows
