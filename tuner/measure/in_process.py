"""Replay a workload against the engine in-process and measure it (`tune bench`).

The driver loop reads as three verbs per iteration: admit (requests whose arrival time has come,
or enough to keep `concurrency` in flight) -> step the engine -> collect finished outputs.
Open-loop arrivals are passed to the engine as the *scheduled* arrival time, so time spent
queueing because the engine is busy counts in TTFT, as a user would see it. Warm-up requests
run first, to completion, and are excluded from every metric.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from slotune.engine.config import EngineConfig
from slotune.tuner.spec.yaml_reader import parse_yaml
from slotune.tuner.measure.metrics import (
    CI_PERCENTILES,
    LATENCY_SERIES,
    PERCENTILES,
    BenchResult,
    MemoryTracker,
    RequestRecord,
    bootstrap_intervals,
    ci_keys,
    cost_metrics,
    engine_stats_delta,
    summarize,
)
from slotune.tuner.spec.slo import metric_key
from slotune.tuner.spec.workload_spec import BenchRequest, WorkloadSpec, iter_requests

DEFAULT_WORKLOAD = "chat-small"


class EngineWindow:
    """What the engine itself saw over one measured run, which a client cannot see: engine
    counters (prefix cache, speculation, preemptions, steps, rejections by reason), the KV-block
    peak of this run, peak memory, weight and KV bytes. Open it when the measured run starts
    (after warm-up, nothing in flight), `sample()` as it goes, read `metrics()` at the end.
    Used by the in-process replay and by a served trial (tuner/trial_runner.py) alike.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        engine.start_stats_window()  # the KV-block peak of this run only
        self._stats0 = engine.stats()
        self._memory = MemoryTracker(str(engine.runner.device))

    def sample(self) -> None:
        self._memory.sample()

    def metrics(self) -> dict[str, float]:
        engine = self.engine
        m = engine_stats_delta(self._stats0, engine.stats())
        m.update(self._memory.metrics())
        m["weight_bytes"] = float(engine.weight_bytes)
        m["kv_bytes_per_token"] = float(engine.kv_bytes_per_token)
        return m


def _run_warmup(engine, warmup: list[BenchRequest], params_for) -> None:
    # First-call allocations, caches and lazy compilation happen here, outside the measurement.
    for r in warmup:
        engine.add_request(r.request_id, r.prompt_token_ids, params_for(r))
    while engine.has_unfinished_requests():
        engine.step()


def run_benchmark(
    cfg,
    workload: WorkloadSpec,
    *,
    llm=None,
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    seed: int | None = None,
    percentiles: tuple[float, ...] = (),
    on_progress: Callable[[int, int | None], None] | None = None,
    should_stop: Callable[[list[RequestRecord]], bool] | None = None,
) -> BenchResult:
    """Replay `workload` on an engine built from `cfg` (or the given `llm`) and measure it.

    Args:
        cfg: the EngineConfig to measure (ignored when `llm` is given: its own config is used
            and reported).
        workload: arrivals, lengths, stop rule, seed.
        llm: reuse a loaded `LLM`; it must be idle. The prefix cache is not cleared between runs.
        ttft_limit_s, tpot_limit_s: per-request limits for goodput / SLO attainment.
        seed: overrides `workload.seed` (robustness re-measurement on fresh requests).
        percentiles: extra pXX to report besides 50/90/95/99 (e.g. the objective's 80).
        on_progress: called with (finished, total) as measured requests finish; total is None
            for a duration-bounded run.
        should_stop: called with the records so far after each finish; True aborts the run
            (a hopeless trial): in-flight requests are aborted and not recorded, pending ones
            never sent, and the result is marked `early_stopped`.
    Returns:
        BenchResult: `metrics` (flat floats: latency percentiles, throughput, goodput, engine
        stats, peak memory) and per-request `records`.
    """
    from slotune.engine import LLM, SamplingParams  # imports torch: only an in-process replay needs it
    from slotune.engine.llm_engine import RequestRejected  # imports torch, as the line above

    llm = llm or LLM(cfg)
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("run_benchmark needs an idle engine: it has unfinished requests")

    def params_for(r: BenchRequest) -> SamplingParams:
        # Fixed output lengths: the workload, not the model's EOS, decides how long each answer is.
        return SamplingParams(max_tokens=r.output_len, ignore_eos=True)

    stream = iter_requests(workload, llm.tokenizer, seed=seed)
    warmup = [next(stream) for _ in range(workload.warmup_requests)]
    _run_warmup(engine, warmup, params_for)

    window = EngineWindow(engine)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    total = workload.num_requests
    records: list[RequestRecord] = []
    num_in_flight = 0
    is_early = False
    next_req: BenchRequest | None = next(stream, None)
    t0 = time.perf_counter()
    end = None if workload.duration_s is None else t0 + workload.duration_s

    def admit(now: float) -> None:
        nonlocal next_req, num_in_flight
        while next_req is not None:
            if workload.is_closed_loop:
                now = time.perf_counter()  # live clock: a run of rejections must not outlast duration_s
                if num_in_flight >= workload.concurrency or (end is not None and now >= end):
                    return
                arrival = now
            else:
                arrival = t0 + next_req.arrival_offset_s
                if arrival > now:
                    return
            r, next_req = next_req, next(stream, None)
            try:
                engine.add_request(r.request_id, r.prompt_token_ids, params_for(r), arrival_time=arrival)
                num_in_flight += 1
            except RequestRejected:  # the engine counts it by reason (num_rejected_<reason> metrics)
                records.append(RequestRecord.rejected(r.request_id, len(r.prompt_token_ids)))
                records[-1].arrival_s = arrival - t0

    def drained(now: float) -> bool:
        if workload.is_closed_loop and end is not None and now >= end:
            return not engine.has_unfinished_requests()
        return next_req is None and not engine.has_unfinished_requests()

    while True:
        now = time.perf_counter()
        admit(now)
        if drained(now):
            break
        if not engine.has_unfinished_requests():  # idle until the next open-loop arrival
            time.sleep(max(0.0, t0 + next_req.arrival_offset_s - time.perf_counter()))
            continue
        outputs = engine.step()
        window.sample()
        for out in outputs:
            if not out.finished:
                continue
            num_in_flight -= 1
            records.append(RequestRecord.from_output(out, t0))
            if on_progress:
                on_progress(len(records), total)
            if should_stop and not is_early and should_stop(records):
                is_early = True
        if is_early:
            for rid in list(engine.seqs):
                engine.abort_request(rid)
            break
    duration = time.perf_counter() - t0

    metrics = summarize(
        records,
        duration,
        ttft_limit_s=ttft_limit_s,
        tpot_limit_s=tpot_limit_s,
        percentiles=tuple(dict.fromkeys((*PERCENTILES, *percentiles))),
    )
    metrics.update(window.metrics())
    return BenchResult(
        config=llm.config.model_dump(mode="json"),
        workload=workload.model_dump(mode="json"),
        metrics=metrics,
        records=records,
        early_stopped=is_early,
        device=str(engine.runner.device),
        started_at=started_at,
    )


def _fmt(v: float | None, scale: float = 1.0) -> str:
    if v is None:
        return "-"
    v *= scale
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _fmt_ci(m: dict[str, float], key: str, scale: float = 1.0) -> str:
    """The value, and its 95% interval when measured: '63.9 (61.2-66.0)'."""
    lo, hi = (m.get(k) for k in ci_keys(key))
    text = _fmt(m.get(key), scale)
    return text if lo is None or hi is None else f"{text} ({_fmt(lo, scale)}-{_fmt(hi, scale)})"


def print_result(res: BenchResult, title: str = "benchmark", percentiles: tuple[float, ...] = PERCENTILES) -> None:
    """Rich tables: latency percentiles (ms), then throughput, goodput, cost (with a price), engine
    stats and failures; the rates and costs with their 95% intervals when measured.

    Rows whose metric the run did not produce (engine stats over HTTP, cost without a price) are left out.
    """
    m = res.metrics
    flag = ", early-stopped" if res.early_stopped else ""
    t = Table(title=f"{title} ({res.device}, {int(m['num_completed'])}/{int(m['num_requests'])} completed{flag})")
    t.add_column("latency (ms)")
    for p in (*percentiles, "mean"):
        t.add_column(f"p{p:g}" if p != "mean" else "mean", justify="right")
    for name in LATENCY_SERIES:
        keys = [metric_key(name, p) for p in percentiles] + [f"{name}_mean"]
        t.add_row(name, *[_fmt(m.get(k), 1e3) for k in keys])
    console = Console()
    console.print(t)
    s = Table(show_header=False, box=None)
    rows = [
        ("output tokens/s", "output_tokens_per_s", 1),
        ("total tokens/s", "total_tokens_per_s", 1),
        ("requests/s", "requests_per_s", 1),
        ("goodput (req/s)", "goodput_rps", 1),
        ("$ per 1M output tokens", "usd_per_1m_output_tokens", 1),
        ("$ per 1M tokens", "usd_per_1m_total_tokens", 1),
        ("SLO attainment", "slo_attainment", 1),
        ("duration (s)", "duration_s", 1),
        ("peak KV blocks", "peak_kv_blocks", 1),
        ("KV blocks total", "num_kv_blocks", 1),
        ("prefix-cache hit rate", "prefix_cache_hit_rate", 1),
        ("spec acceptance rate", "spec_acceptance_rate", 1),
        ("spec mean accepted length", "spec_mean_accepted_length", 1),
        ("preemptions", "num_preemptions", 1),
        ("rejected", "num_rejected", 1),
        ("peak memory (MB)", "peak_memory_mb", 1),
        ("weights (MB)", "weight_bytes", 1e-6),
        ("short outputs (ignore_eos not honoured?)", "num_short_outputs", 1),
        ("client CPU (s)", "client_cpu_s", 1),
        ("failed", "num_failed", 1),
    ]
    for label, key, scale in rows:
        if key in m:
            s.add_row(label, _fmt_ci(m, key, scale))
    for key in sorted(k for k in m if k.startswith("num_failed_")):  # by HTTP status or cause (tuner/http_bench.py)
        s.add_row(f"  failed: {key.removeprefix('num_failed_')}", _fmt(m[key]))
    console.print(s)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` items -> {dotted.key: value}, values parsed as plain YAML (8 -> int, true -> bool) by the
    one YAML reader (tuner/errors.py: no tags; a problem names `--set KEY`)."""
    out: dict[str, Any] = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k.strip():
            raise ValueError(f"--set expects key=value (e.g. max_num_seqs=8 or speculative.method=ngram), got '{item}'")
        out[k.strip()] = parse_yaml(v, f"--set {k.strip()}")
    return out


def load_tokenizer(model: str):
    """The tokenizer of a model reference as `EngineConfig.model` takes it, without the weights."""
    # engine.loader imports torch (it also reads weights): only `tune bench --url` pays for it here.
    from slotune.engine.loader import resolve_model_path
    from slotune.engine.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model_path(model))


def bench_command(
    config: Path | None,
    workload: Path | str | None,
    json_out: Path | None,
    overrides: list[str],
    seed: int | None,
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    *,
    url: str | None = None,
    api_key: str | None = None,
    model: str | None = None,
    api: str | None = None,
    tokenizer: str | None = None,
    usd_per_hour: float | None = None,
) -> BenchResult:
    """`tune bench`: load config (+ overrides) and workload, replay, print tables, write JSON.

    With `url`, no engine is built: the workload is replayed against that OpenAI-compatible
    server (tuner/http_bench.py), its prompts made with the tokenizer of `tokenizer` (a model
    reference), else of CONFIG's model, else of the default model. The metrics carry their 95%
    intervals (`metrics.bootstrap_intervals`) and, with `usd_per_hour` (the server's price per
    hour), the cost per 1M output and total tokens (`metrics.cost_metrics`).
    """
    if usd_per_hour is not None and not 0 < usd_per_hour < float("inf"):
        raise ValueError(f"--usd-per-hour: must be a price > 0, got {usd_per_hour}")
    if url is None:
        for flag, value in (("--model", model), ("--api", api), ("--tokenizer", tokenizer)):
            if value is not None:
                raise ValueError(f"{flag}: only applies with --url (measuring a running server)")
    elif overrides:
        raise ValueError(
            f"--set: changes the engine config, but --url measures a running server; configure that "
            f"server instead (got {', '.join(overrides)})"
        )
    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    if overrides:
        cfg = cfg.with_updates(parse_overrides(overrides))
    wl = WorkloadSpec.load(workload if workload else DEFAULT_WORKLOAD)
    total = wl.num_requests
    where = f" @ {url}" if url else ""
    with Console(stderr=True).status(f"replaying {wl.name}{where}") as status:

        def progress(done: int, n: int | None) -> None:
            status.update(f"replaying {wl.name}{where}: {done}/{n if n else '?'} requests")

        if url is None:
            res = run_benchmark(
                cfg, wl, seed=seed, ttft_limit_s=ttft_limit_s, tpot_limit_s=tpot_limit_s, on_progress=progress
            )
        else:
            # Imported here: aiohttp is only needed with --url.
            from slotune.tuner.measure.http_replay import run_http_benchmark

            status.update(f"loading the tokenizer of {tokenizer or cfg.model}")
            tok = load_tokenizer(tokenizer or cfg.model)
            res = run_http_benchmark(
                url,
                wl,
                tokenizer=tok,
                api_key=api_key,
                model=model,
                api=api or "completions",
                seed=seed,
                ttft_limit_s=ttft_limit_s,
                tpot_limit_s=tpot_limit_s,
                on_progress=progress,
            )
    res.metrics.update(
        bootstrap_intervals(
            res.records,
            res.metrics["duration_s"],
            ttft_limit_s=ttft_limit_s,
            tpot_limit_s=tpot_limit_s,
            percentiles=CI_PERCENTILES,
        )
    )
    if usd_per_hour is not None:
        res.metrics.update(cost_metrics(res.metrics, usd_per_hour))
    print_result(res, title=f"tune bench: {wl.name}" + (f" ({total} requests)" if total else "") + where)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res.to_dict(), indent=1))
    return res
