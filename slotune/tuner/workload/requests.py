"""Generate a workload's requests: prompt and output lengths, arrival gaps (stratified or independent),
shared prefixes, trace replays; the same seed gives the same requests."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib import resources
from statistics import NormalDist

import numpy as np
from slotune.tuner.spec.trace_reader import load_trace
from slotune.tuner.spec.traces import Trace
from slotune.tuner.spec.workload_spec import (
    BUILTIN_DIR,
    STRATUM_BLOCK,
    Fixed,
    Length,
    Uniform,
    WorkloadSpec,
    read_trace,
)
from slotune.tuner.spec.yaml_reader import SpecError
from slotune.tuner.workload.prompts import iter_prompts

CORPUS_FILE = "corpus.txt"


_STANDARD_NORMAL = NormalDist()


@dataclass(slots=True)
class WorkloadRequest:
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
        bos = self.tok.encode("", add_special_tokens=True)  # [BOS] where the vocabulary starts text with it
        return bos + ((self.prefix_ids + ids) if with_prefix else ids)


def iter_requests(spec: WorkloadSpec, tokenizer, *, seed: int | None = None) -> Iterator[WorkloadRequest]:
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
                yield WorkloadRequest(f"warmup-{i}", prompter.build(body, with_prefix), olen, 0.0, is_warmup=True)
                continue
            if not spec.is_closed_loop and spec.duration_s is not None and t > spec.duration_s:
                break
            yield WorkloadRequest(f"req-{i}", prompter.build(body, with_prefix), olen, t)
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


def _iter_trace_requests(spec: WorkloadSpec, tokenizer, seed: int) -> Iterator[WorkloadRequest]:
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
        yield WorkloadRequest(f"warmup-{i}", ids, max(1, r.output_tokens), 0.0, is_warmup=True)
    for i, (r, ids) in enumerate(zip(trace.requests, iter_prompts(trace, corpus, seed=seed))):
        yield WorkloadRequest(f"req-{i}", ids, max(1, r.output_tokens), r.arrival_s)


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
) -> list[WorkloadRequest]:
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
            "(or replay it with run_in_process_replay, which stops at duration_s)"
        )
    out, num_measured = [], 0
    for r in iter_requests(spec, tokenizer, seed=seed):
        if not r.is_warmup:
            if max_requests is not None and num_measured >= max_requests:
                break
            num_measured += 1
        out.append(r)
    return out
