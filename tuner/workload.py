"""Workloads as data: arrivals, prompt/output length distributions, shared prefixes; seeded.

A `WorkloadSpec` expands into a reproducible stream of `BenchRequest`s: the same spec and seed
give the same token ids, arrival offsets and output lengths on any machine. Each request draws
a fixed number of values from its own generator in a fixed order, so request i does not depend
on how many requests follow it, and warm-up requests (a separate stream) never shift the
measured ones.

Prompts are windows of real English text (`workloads/corpus.txt`, see `workloads/SOURCES.md`),
so the tokenizer, prefix cache and n-gram speculation see realistic token statistics.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slotune.tuner.errors import MissingFileError, SpecError, load_yaml_mapping

BUILTIN_DIR = "workloads"
CORPUS_FILE = "corpus.txt"
_DEFAULT_NUM_REQUESTS = 16
MAX_SEED = 2**32 - 1  # numpy's legacy RandomState (Optuna's samplers) takes seeds below 2**32
MAX_LEN = 2**24  # tokens; beyond any model's context, and far from int64 overflow in numpy's draws


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


class WorkloadSpec(_Strict):
    """What traffic a benchmark or trial replays.

    Stop rule: `num_requests`, `duration_s`, or both (whichever comes first). Open loop
    (poisson, fixed_rate) stops generating arrivals after `duration_s`; closed loop stops
    issuing new requests once `duration_s` has passed and lets the in-flight ones finish.
    """

    name: str = "custom"
    description: str = ""
    mode: Literal["completion", "chat"] = Field(
        "completion", description="chat: prompt text goes through the model's chat template (shared prefix as system)")
    arrivals: Literal["poisson", "fixed_rate", "closed_loop"] = "closed_loop"
    rate: float | None = Field(None, gt=0, description="requests/s for poisson and fixed_rate")
    concurrency: int = Field(4, ge=1, description="requests kept in flight for closed_loop")
    num_requests: int | None = Field(None, ge=1, description=f"measured requests (default {_DEFAULT_NUM_REQUESTS} "
                                                             "unless duration_s is given)")
    duration_s: float | None = Field(None, gt=0, description="stop issuing requests after this long")
    warmup_requests: int = Field(1, ge=0, description="run first, excluded from metrics")
    prompt_len: Length = Field(default_factory=lambda: Fixed(value=64), discriminator="kind")
    output_len: Length = Field(default_factory=lambda: Fixed(value=32), discriminator="kind")
    trace: str | None = Field(None, description="JSONL file: one {prompt | prompt_len, output_len} per line; "
                                                "replaces prompt_len/output_len (cycled if shorter)")
    shared_prefix: SharedPrefix | None = None
    seed: int = Field(0, ge=0, le=MAX_SEED)

    @model_validator(mode="before")
    @classmethod
    def _default_count(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("num_requests") is None and data.get("duration_s") is None:
            data = {**data, "num_requests": _DEFAULT_NUM_REQUESTS}
        return data

    @model_validator(mode="after")
    def _check(self) -> "WorkloadSpec":
        if self.arrivals in ("poisson", "fixed_rate") and self.rate is None:
            raise ValueError(f"rate is required when arrivals is '{self.arrivals}' (requests per second)")
        return self

    @property
    def is_closed_loop(self) -> bool:
        return self.arrivals == "closed_loop"

    @classmethod
    def load(cls, ref: "str | Path | dict | WorkloadSpec") -> "WorkloadSpec":
        """A spec from a mapping, a YAML path, or a built-in name (chat-small, batch-mixed, shared-prefix).

        A relative `trace` path in a YAML file is resolved against that file's folder.
        """
        if isinstance(ref, WorkloadSpec):
            return ref
        if isinstance(ref, dict):
            return cls.model_validate(ref)
        path = Path(ref)
        if path.suffix in (".yaml", ".yml", ".json") or path.exists():
            base: Path | None = path.parent
        else:
            names = builtin_workloads()
            if str(ref) not in names:
                raise ValueError(f"unknown workload '{ref}': not a file, and not a built-in ({', '.join(sorted(names))})")
            path, base = names[str(ref)], None
        data = load_yaml_mapping(path, "workload file", empty_ok=True)
        try:
            spec = cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError.from_validation(exc, path) from None
        if spec.trace and base is not None:
            trace = Path(spec.trace).expanduser()
            spec = spec.model_copy(update={"trace": str(trace if trace.is_absolute() else base / trace)})
            if not Path(spec.trace).is_file():
                raise MissingFileError(f"trace file not found: {spec.trace}", source=path, field="trace")
        return spec


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


def _draw(dist: Length, rng: np.random.Generator) -> int:
    if isinstance(dist, Fixed):
        return dist.value
    if isinstance(dist, Uniform):
        return int(rng.integers(dist.min, dist.max + 1))
    v = rng.lognormal(np.log(dist.mean), dist.sigma)
    return int(np.clip(round(v), dist.min, dist.max))


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a JSONL trace, each checked: `output_len` and one of `prompt` (text) / `prompt_len`.

    Raises MissingFileError, or SpecError naming the line.
    """
    p = Path(path)
    if not p.is_file():
        raise MissingFileError("trace file not found" + (" (a directory)" if p.is_dir() else ""), source=p)
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
            raise SpecError(f"each line needs output_len and one of prompt / prompt_len, got {sorted(row)}", source=p, line=i)
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
                {"role": "user", "content": text}]
            return self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True))
        ids = self.tok.encode(body) if isinstance(body, str) else body
        return (self.prefix_ids + ids) if with_prefix else ids


def iter_requests(spec: WorkloadSpec, tokenizer, *, seed: int | None = None) -> Iterator[BenchRequest]:
    """Warm-up requests first (ids 'warmup-N'), then measured ones ('req-N') until the stop rule.

    Unbounded (closed loop with only `duration_s`): the caller stops pulling.
    """
    seed = spec.seed if seed is None else seed
    prompter = _Prompter(spec, tokenizer)
    rows = read_trace(spec.trace) if spec.trace else None
    # A fixed draw order per request: gap, prompt_len, output_len, window start, prefix coin.
    for is_warmup, stream in ((True, 1), (False, 0)):
        rng = np.random.default_rng([seed, stream])
        count = spec.warmup_requests if is_warmup else spec.num_requests
        t = 0.0
        for i in itertools.count():
            if count is not None and i >= count:
                break
            gap = float(rng.exponential(1.0 / spec.rate)) if spec.arrivals == "poisson" else (
                1.0 / spec.rate if spec.arrivals == "fixed_rate" else 0.0)
            plen, olen = _draw(spec.prompt_len, rng), _draw(spec.output_len, rng)
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
            t += gap


def generate_requests(spec: WorkloadSpec, tokenizer, *, seed: int | None = None,
                      max_requests: int | None = None) -> list[BenchRequest]:
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
        raise ValueError("closed-loop workload with only duration_s is unbounded: pass max_requests "
                         "(or replay it with run_benchmark, which stops at duration_s)")
    out, num_measured = [], 0
    for r in iter_requests(spec, tokenizer, seed=seed):
        if not r.is_warmup:
            if max_requests is not None and num_measured >= max_requests:
                break
            num_measured += 1
        out.append(r)
    return out
