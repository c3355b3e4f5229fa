"""Workloads as data: arrivals, prompt/output length distributions, shared prefixes; seeded.

A `WorkloadSpec` expands into a reproducible stream of `BenchRequest`s: the same spec and seed
give the same token ids, arrival offsets and output lengths on any machine. Each request draws
its values from one generator per stream in a fixed order, so request i does not depend on how
many requests follow it, and warm-up requests (a separate stream) never shift the measured ones.

Or a workload replays a recorded trace (`trace: {path: ...}`, tuner/traces.py): the traced
arrival times (open loop), prompt and output lengths, and prompts rebuilt from the trace's block
hash ids so that requests share exactly the prefixes the traced ones shared.

Lengths are stratified by default (`length_sampling`): each block of 8 requests takes one length
from each eighth of the distribution, in a random order, so that a seed changes which requests are
long but hardly the workload's total tokens. Independent draws of example 02's 24 lognormal
(sigma 0.6) output lengths vary the total by 11.7% (coefficient of variation over 300 seeds), and
with it every throughput a trial measures; stratified, by 2.6% (bench/workload/seed_spread.py).

Open-loop gaps are stratified the same way (`arrival_sampling`): each block of 8 gaps takes one
from each eighth of the exponential (Poisson) or gamma distribution, so every gap keeps the
distribution asked for, bursts included, while a seed moves the replay's mean rate much less.
Independent gaps make example 06's 24 Poisson arrivals span 11.6 s +- 21% (coefficient of
variation over 300 seeds), and its queueing-bound TTFT moves with the span; stratified, +- 8%
(bench/workload/seed_spread.py).

Prompts are windows of real English text (`workloads/corpus.txt`, see `workloads/SOURCES.md`),
so the tokenizer, prefix cache and n-gram speculation see realistic token statistics.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from statistics import NormalDist
from typing import Any, Literal, Union

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from slotune.tuner.spec.yaml_reader import MissingFileError, SpecError, load_yaml_mapping
from slotune.tuner.spec.traces import Trace, TraceSource, iter_prompts, load_trace

BUILTIN_DIR = "workloads"
CORPUS_FILE = "corpus.txt"
_DEFAULT_NUM_REQUESTS = 16
MAX_SEED = 2**32 - 1  # numpy's legacy RandomState (Optuna's samplers) takes seeds below 2**32
MAX_LEN = 2**24  # tokens; beyond any model's context, and far from int64 overflow in numpy's draws
_STANDARD_NORMAL = NormalDist()
STRATUM_BLOCK = 8  # stratified lengths and gaps: each block of this many covers every 1/8 of the distribution


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Fixed(_Strict):
    kind: Literal["fixed"] = "fixed"
    value: int = Field(ge=1, le=MAX_LEN)


class Uniform(_Strict):
    kind: Literal["uniform"] = "uniform"
    min: int = Field(ge=1, le=MAX_LEN)
    max: int = Field(ge=1, le=MAX_LEN)

    @model_validator(mode="after")
    def _check(self) -> "Uniform":
        if self.min > self.max:
            raise ValueError(f"uniform: min ({self.min}) must be <= max ({self.max})")
        return self


class LogNormal(_Strict):
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


class SharedPrefix(_Strict):
    """A common start (system prompt, retrieved context) that a share of requests begin with."""

    num_tokens: int | None = Field(None, ge=1, le=MAX_LEN, description="prefix length, taken from the corpus")
    text: str | None = Field(None, min_length=1, description="or: this exact text")
    fraction: float = Field(1.0, ge=0, le=1, description="share of requests that start with it")

    @model_validator(mode="after")
    def _check(self) -> "SharedPrefix":
        if (self.num_tokens is None) == (self.text is None):
            raise ValueError("shared_prefix: give exactly one of num_tokens or text")
        return self


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


class WorkloadSpec(_Strict):
    """What traffic a benchmark or trial replays.

    Arrivals: `closed_loop` keeps `concurrency` requests in flight; open loop sends each request at
    its arrival time whatever is in flight: `poisson` (exponential gaps at `rate`), `fixed_rate`,
    `gamma` (gamma gaps with shape `burstiness` and mean 1/rate: coefficient of variation
    1/sqrt(burstiness), so burstiness 1 is Poisson, below 1 burstier, above 1 more even; as vLLM's
    `--burstiness`), or `trace` (the arrival times of `trace: {path: ...}`).

    Stop rule: `num_requests`, `duration_s`, or both (whichever comes first). Open loop stops
    generating arrivals after `duration_s`; closed loop stops issuing new requests once
    `duration_s` has passed and lets the in-flight ones finish. A trace replay sends every request
    of the trace (after `trace.window` and `trace.max_requests`).

    `trace` as a string is a lengths file (JSONL, one {prompt | prompt_len, output_len} per line,
    cycled) that replaces prompt_len/output_len under any arrivals; as a mapping (`TraceSource`) it
    is a recorded, Mooncake, Azure or BurstGPT trace replayed whole: arrivals, lengths and prefix
    sharing all come from it, so prompt_len, output_len, shared_prefix, rate, duration_s and
    num_requests are refused beside it.
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
    length_sampling: Literal["stratified", "independent"] = Field(
        "stratified",
        description=f"stratified: each block of {STRATUM_BLOCK} requests draws one prompt and one "
        f"output length from each 1/{STRATUM_BLOCK} of its distribution (in a random "
        "order), so seeds differ in which requests are long, hardly in total tokens; "
        "independent: every length drawn on its own",
    )
    arrival_sampling: Literal["stratified", "independent"] = Field(
        "stratified",
        description=f"poisson and gamma arrivals; stratified: each block of {STRATUM_BLOCK} gaps draws "
        f"one from each 1/{STRATUM_BLOCK} of the gaps' distribution (in a random order), "
        "so every gap keeps that distribution while seeds differ less in the replay's "
        "mean rate (24 Poisson arrivals span +-8% from seed to seed, independent +-21%); "
        "independent: every gap drawn on its own",
    )
    trace: str | TraceSource | None = Field(
        None,
        description="a lengths file (JSONL: one {prompt | prompt_len, output_len} per line; replaces "
        "prompt_len/output_len, cycled if shorter), or a mapping {path, format, block_size, "
        "time_scale, window, max_requests}: a recorded/Mooncake/Azure/BurstGPT trace to replay",
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
    """Built-in workload names -> their YAML files (package data in tuner/workloads/)."""
    root = resources.files("slotune.tuner") / BUILTIN_DIR
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


@dataclass(slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_offset_s: float  # open loop: when it arrives, relative to the start (0 for closed loop)
    is_warmup: bool = False


def corpus_text() -> str:
    return (resources.files("slotune.tuner") / BUILTIN_DIR / CORPUS_FILE).read_text()


def corpus_token_ids(tokenizer) -> list[int]:
    """The bundled public-domain-licensed corpus (GPL-3 text, see SOURCES.md), tokenized."""
    return tokenizer.encode(corpus_text())


def _length(dist: Length, u: float) -> int:
    """The length at quantile `u` (0 < u < 1) of `dist`: its inverse CDF, rounded and clipped."""
    if isinstance(dist, Fixed):
        return dist.value
    if isinstance(dist, Uniform):
        return min(dist.min + int(u * (dist.max - dist.min + 1)), dist.max)
    v = dist.mean * math.exp(dist.sigma * _STANDARD_NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12)))
    return int(np.clip(round(v), dist.min, dist.max))


def _quantiles(rng: np.random.Generator, stratified: bool) -> Iterator[float]:
    """Quantiles (0 <= u < 1) to draw values at, one per request (a length) or per arrival (a gap).
    Stratified: each block of STRATUM_BLOCK takes one from each 1/STRATUM_BLOCK of [0, 1), in a random
    order; the block is drawn whole, so request i depends only on its own block, never on how many
    requests follow."""
    while True:
        if stratified:
            us = (rng.permutation(STRATUM_BLOCK) + rng.random(STRATUM_BLOCK)) / STRATUM_BLOCK
        else:
            us = rng.random(1)
        yield from (float(u) for u in us)


def _lengths(dist: Length, rng: np.random.Generator, stratified: bool) -> Iterator[int]:
    """Lengths drawn from `dist`, one per request (stratified: see `_quantiles`)."""
    return (_length(dist, u) for u in _quantiles(rng, stratified))


def length_streams(spec: WorkloadSpec, seed: int, stream: int = 0) -> tuple[Iterator[int], Iterator[int]]:
    """The prompt and output lengths, one per request, of `spec` on `seed`: the measured requests'
    (stream 0) or the warm-up's (stream 1), each from a generator of its own."""
    stratified = spec.length_sampling == "stratified"
    return (
        _lengths(spec.prompt_len, np.random.default_rng([seed, stream, 1]), stratified),
        _lengths(spec.output_len, np.random.default_rng([seed, stream, 2]), stratified),
    )


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


class _Prompter:
    """Turns (length, start) draws into token ids: corpus windows, optional prefix, chat template."""

    def __init__(self, spec: WorkloadSpec, tokenizer) -> None:
        self.spec, self.tok = spec, tokenizer
        self.corpus = corpus_token_ids(tokenizer)
        sp = spec.shared_prefix
        self.prefix_ids: list[int] = []
        self.prefix_text = ""
        if sp is not None:
            self.prefix_ids = tokenizer.encode(sp.text) if sp.text else self.window(0, sp.num_tokens)
            self.prefix_text = sp.text or tokenizer.decode(self.prefix_ids)

    def window(self, start: int, n: int) -> list[int]:
        c = self.corpus
        return [c[(start + j) % len(c)] for j in range(n)]

    def build(self, body: list[int] | str, with_prefix: bool) -> list[int]:
        if self.spec.mode == "chat":
            text = body if isinstance(body, str) else self.tok.decode(body)
            messages = ([{"role": "system", "content": self.prefix_text}] if with_prefix else []) + [
                {"role": "user", "content": text}
            ]
            return self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True))
        ids = self.tok.encode(body) if isinstance(body, str) else body
        return (self.prefix_ids + ids) if with_prefix else ids


def iter_requests(spec: WorkloadSpec, tokenizer, *, seed: int | None = None) -> Iterator[BenchRequest]:
    """Warm-up requests first (ids 'warmup-N'), then measured ones ('req-N') until the stop rule.

    Unbounded (closed loop with only `duration_s`): the caller stops pulling.
    """
    seed = spec.seed if seed is None else seed
    if spec.trace_source is not None:
        yield from _iter_trace_requests(spec, tokenizer, seed)
        return
    prompter = _Prompter(spec, tokenizer)
    rows = read_trace(spec.trace) if spec.trace else None
    # A fixed draw order per request: window start, prefix coin; the lengths and the measured requests'
    # gaps from streams of their own, so that prompts do not depend on the arrivals, nor lengths on either.
    gaps = arrival_gaps(spec, seed)
    for is_warmup, stream in ((True, 1), (False, 0)):
        rng = np.random.default_rng([seed, stream])
        prompt_lens, output_lens = length_streams(spec, seed, stream)
        count = spec.warmup_requests if is_warmup else spec.num_requests
        t = 0.0
        for i in itertools.count():
            if count is not None and i >= count:
                break
            plen, olen = next(prompt_lens), next(output_lens)
            start = int(rng.integers(0, len(prompter.corpus)))
            with_prefix = spec.shared_prefix is not None and bool(rng.random() < spec.shared_prefix.fraction)
            if rows is not None:
                row = rows[i % len(rows)]
                body = row["prompt"] if "prompt" in row else prompter.window(start, int(row["prompt_len"]))
                olen = int(row["output_len"])
            else:
                body = prompter.window(start, plen)
            if is_warmup:
                yield BenchRequest(f"warmup-{i}", prompter.build(body, with_prefix), olen, 0.0, is_warmup=True)
                continue
            if not spec.is_closed_loop and spec.duration_s is not None and t > spec.duration_s:
                break
            yield BenchRequest(f"req-{i}", prompter.build(body, with_prefix), olen, t)
            t += next(gaps)


def arrival_gaps(spec: WorkloadSpec, seed: int) -> Iterator[float]:
    """Seconds from each measured arrival to the next, on `seed` (0 for closed loop, where arrivals are
    not scheduled), from a generator of their own. Poisson gaps are exponential with mean 1/rate;
    gamma gaps have shape k = burstiness and scale 1/(rate k): mean 1/rate, CV 1/sqrt(k). Each is
    the distribution's inverse CDF at a quantile of `_quantiles` (stratified per `arrival_sampling`)."""
    if spec.arrivals not in ("poisson", "gamma"):
        yield from itertools.repeat(1.0 / spec.rate if spec.arrivals == "fixed_rate" else 0.0)
        return
    us = _quantiles(np.random.default_rng([seed, 0, 3]), spec.arrival_sampling == "stratified")
    if spec.arrivals == "poisson":
        yield from (-math.log1p(-u) / spec.rate for u in us)
    else:  # scipy imported here only: the served trial's client process imports this module at start
        from scipy.special import gammaincinv

        k = spec.burstiness
        yield from (float(gammaincinv(k, u)) / (spec.rate * k) for u in us)


def _iter_trace_requests(spec: WorkloadSpec, tokenizer, seed: int) -> Iterator[BenchRequest]:
    """A trace replay: every traced request at its traced arrival time, lengths as traced.

    Prompts are rebuilt from the trace's hash ids (traces.iter_prompts), so shared blocks are
    shared again. Warm-up requests take the first traced requests' lengths (cycled) with fresh
    tokens only (stream 1, hash ids dropped): nothing they leave in the prefix cache is a block a
    measured request asks for. A traced request that produced no tokens (failed, aborted) is
    replayed as a 1-token answer: `describe_replay` counts them.
    """
    trace = load_trace(spec.trace_source)
    corpus = corpus_token_ids(tokenizer)
    warm = [replace(trace.requests[i % len(trace)], hash_ids=None) for i in range(spec.warmup_requests)]
    warm_prompts = iter_prompts(Trace(warm, trace.source, trace.format, None), corpus, seed=seed, stream=1)
    for i, (r, ids) in enumerate(zip(warm, warm_prompts)):
        yield BenchRequest(f"warmup-{i}", ids, max(1, r.output_tokens), 0.0, is_warmup=True)
    for i, (r, ids) in enumerate(zip(trace.requests, iter_prompts(trace, corpus, seed=seed))):
        yield BenchRequest(f"req-{i}", ids, max(1, r.output_tokens), r.arrival_s)


def describe_replay(spec: WorkloadSpec) -> str | None:
    """Which traffic a trace workload replays, in one sentence (the study report and `tune validate`
    state it); None for a workload that replays no trace mapping.

    Loads the trace; a trace that cannot be read is said in the sentence, not raised.
    """
    src = spec.trace_source
    if src is None:
        return None
    window = f"window [{src.window[0]:g}, {src.window[1]:g}) s" if src.window else "the whole trace"
    cap = f", first {src.max_requests} requests" if src.max_requests else ""

    def head(fmt: str) -> str:
        return f"trace {src.path} ({fmt}), {window}{cap}, time_scale {src.time_scale:g}"

    try:
        trace = load_trace(src)
    except (SpecError, OSError) as exc:
        return f"{head(src.format or 'format not detected')}: cannot be read ({exc})"
    span = trace.requests[-1].arrival_s
    rate = f" ({(len(trace) - 1) / span:.3g} requests/s)" if span > 0 else ""
    silent = sum(r.output_tokens == 0 for r in trace.requests)
    note = f"; {silent} traced requests with no output replayed as 1-token answers" if silent else ""
    return (
        f"{head(trace.format)}: {len(trace)} requests over {span:.1f} s{rate}, replayed open loop at the traced "
        f"times (+ {spec.warmup_requests} warm-up){note}"
    )


def generate_requests(
    spec: WorkloadSpec, tokenizer, *, seed: int | None = None, max_requests: int | None = None
) -> list[BenchRequest]:
    """Expand a spec into concrete requests: warm-up requests first, then measured ones.

    Args:
        spec: the workload.
        tokenizer: the engine's tokenizer (`encode`, `decode`, `apply_chat_template`).
        seed: overrides `spec.seed`.
        max_requests: cap on measured requests; required when the spec is unbounded
            (closed loop with only `duration_s`).
    Returns:
        BenchRequests; the same spec + seed always give the same list.
    """
    if spec.num_requests is None and spec.is_closed_loop and max_requests is None:
        raise ValueError(
            "closed-loop workload with only duration_s is unbounded: pass max_requests "
            "(or replay it with run_benchmark, which stops at duration_s)"
        )
    out, num_measured = [], 0
    for r in iter_requests(spec, tokenizer, seed=seed):
        if not r.is_warmup:
            if max_requests is not None and num_measured >= max_requests:
                break
            num_measured += 1
        out.append(r)
    return out
