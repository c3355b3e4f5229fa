"""Workloads as data: arrivals, prompt/output length distributions, shared prefixes; seeded.

A `WorkloadSpec` expands into a reproducible list of `BenchRequest`s: the same spec and seed
give the same token ids, arrival offsets and output lengths on any machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal, Union

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

BUILTIN_DIR = "workloads"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Fixed(_Strict):
    kind: Literal["fixed"] = "fixed"
    value: int = Field(ge=1)


class Uniform(_Strict):
    kind: Literal["uniform"] = "uniform"
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _check(self) -> "Uniform":
        if self.min > self.max:
            raise ValueError(f"uniform: min ({self.min}) must be <= max ({self.max})")
        return self


class LogNormal(_Strict):
    kind: Literal["lognormal"] = "lognormal"
    mean: float = Field(gt=0, description="median length in tokens")
    sigma: float = Field(0.5, ge=0)
    min: int = Field(1, ge=1)
    max: int = Field(4096, ge=1)


Length = Union[Fixed, Uniform, LogNormal]  # noqa: UP007


class SharedPrefix(_Strict):
    num_tokens: int = Field(ge=1, description="length of the common prefix (e.g. a system prompt)")
    fraction: float = Field(1.0, ge=0, le=1, description="share of requests that start with it")


class WorkloadSpec(_Strict):
    """What traffic a benchmark or trial replays."""

    name: str = "custom"
    arrivals: Literal["poisson", "fixed_rate", "closed_loop"] = "closed_loop"
    rate: float | None = Field(None, gt=0, description="requests/s for poisson and fixed_rate")
    concurrency: int = Field(4, ge=1, description="requests kept in flight for closed_loop")
    num_requests: int = Field(16, ge=1)
    warmup_requests: int = Field(1, ge=0, description="run first, excluded from metrics")
    prompt_len: Length = Field(default_factory=lambda: Fixed(value=64), discriminator="kind")
    output_len: Length = Field(default_factory=lambda: Fixed(value=32), discriminator="kind")
    trace: str | None = Field(None, description="JSONL file: one {prompt_len|prompt, output_len} per line")
    shared_prefix: SharedPrefix | None = None
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "WorkloadSpec":
        if self.arrivals in ("poisson", "fixed_rate") and self.rate is None:
            raise ValueError(f"rate is required when arrivals is '{self.arrivals}' (requests per second)")
        return self

    @classmethod
    def load(cls, ref: "str | Path | dict | WorkloadSpec") -> "WorkloadSpec":
        """A spec from a mapping, a YAML path, or a built-in name (chat-small, batch-mixed, shared-prefix)."""
        if isinstance(ref, WorkloadSpec):
            return ref
        if isinstance(ref, dict):
            return cls.model_validate(ref)
        path = Path(ref)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.exists():
                raise FileNotFoundError(f"workload file not found: {path}")
            data = yaml.safe_load(path.read_text()) or {}
            base = path.parent
        else:
            names = builtin_workloads()
            if str(ref) not in names:
                raise ValueError(f"unknown workload '{ref}': not a file, and not a built-in ({', '.join(sorted(names))})")
            data = yaml.safe_load(names[str(ref)].read_text())
            base = None
        spec = cls.model_validate(data)
        if spec.trace and base is not None and not Path(spec.trace).is_absolute():
            spec = spec.model_copy(update={"trace": str(base / spec.trace)})
        return spec


def builtin_workloads() -> dict[str, Path]:
    root = resources.files("slotune.tuner") / BUILTIN_DIR
    return {Path(p.name).stem: Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml")}


@dataclass(slots=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: list[int]
    output_len: int
    arrival_offset_s: float  # open loop: when it arrives, relative to the start


def _draw(dist: Length, rng: np.random.Generator, n: int) -> np.ndarray:
    if isinstance(dist, Fixed):
        return np.full(n, dist.value)
    if isinstance(dist, Uniform):
        return rng.integers(dist.min, dist.max + 1, size=n)
    v = rng.lognormal(np.log(dist.mean), dist.sigma, size=n)
    return np.clip(np.round(v), dist.min, dist.max).astype(int)


def corpus_token_ids(tokenizer) -> list[int]:
    """Real English text (this module's package docs and the engine's source docstrings are not
    prose); we use the bundled corpus shipped as package data, tokenized once."""
    text = (resources.files("slotune.tuner") / BUILTIN_DIR / "corpus.txt").read_text()
    return tokenizer.encode(text)


def generate_requests(spec: WorkloadSpec, tokenizer, *, seed: int | None = None) -> list[BenchRequest]:
    """Expand a spec into concrete requests (warm-up requests first, ids prefixed 'warmup-')."""
    rng = np.random.default_rng(spec.seed if seed is None else seed)
    corpus = corpus_token_ids(tokenizer)
    n = spec.num_requests + spec.warmup_requests
    if spec.trace:
        rows = [json.loads(line) for line in Path(spec.trace).read_text().splitlines() if line.strip()]
        if not rows:
            raise ValueError(f"trace {spec.trace} is empty")
        rows = [rows[i % len(rows)] for i in range(n)]
        prompts = [tokenizer.encode(r["prompt"]) if "prompt" in r else None for r in rows]
        plens = np.array([len(p) if p else int(r["prompt_len"]) for p, r in zip(prompts, rows)])
        olens = np.array([int(r["output_len"]) for r in rows])
    else:
        prompts = [None] * n
        plens, olens = _draw(spec.prompt_len, rng, n), _draw(spec.output_len, rng, n)
    prefix: list[int] = []
    if spec.shared_prefix:
        prefix = [corpus[i % len(corpus)] for i in range(spec.shared_prefix.num_tokens)]
    if spec.arrivals == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, size=n)
    elif spec.arrivals == "fixed_rate":
        gaps = np.full(n, 1.0 / spec.rate)
    else:
        gaps = np.zeros(n)
    offsets = np.cumsum(gaps) - gaps[0]
    out = []
    for i in range(n):
        ids = prompts[i]
        if ids is None:
            start = int(rng.integers(0, len(corpus)))
            ids = [corpus[(start + j) % len(corpus)] for j in range(int(plens[i]))]
        if prefix and rng.random() < spec.shared_prefix.fraction:
            ids = prefix + ids
        rid = f"warmup-{i}" if i < spec.warmup_requests else f"req-{i - spec.warmup_requests}"
        out.append(BenchRequest(rid, ids, int(olens[i]), float(offsets[i])))
    return out
