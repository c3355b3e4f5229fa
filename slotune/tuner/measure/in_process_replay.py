"""Replay a workload against the engine in-process and measure it (`tune bench`).

The driver loop reads as three verbs per iteration: admit (requests whose arrival time has come,
or enough to keep `concurrency` in flight) -> step the engine -> collect finished outputs.
Open-loop arrivals are passed to the engine as the *scheduled* arrival time, so time spent
queueing because the engine is busy counts in TTFT, as a user would see it. Warm-up requests
run first, to completion, and are excluded from every metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone

from slotune.tuner.measure.memory import MemoryTracker
from slotune.tuner.measure.metrics import PERCENTILES, ReplayResult, RequestRecord, engine_stats_delta, summarize
from slotune.tuner.spec.workload_spec import WorkloadSpec
from slotune.tuner.workload.requests import WorkloadRequest, iter_requests

DEFAULT_WORKLOAD = "chat-small"


class EngineWindow:
    """What the engine itself saw over one measured run, which a client cannot see: engine
    counters (prefix cache, speculation, preemptions, steps, rejections by reason), the KV-block
    peak of this run, peak memory, weight and KV bytes. Open it when the measured run starts
    (after warm-up, nothing in flight), `sample()` as it goes, read `metrics()` at the end.
    Used by the in-process replay and by a served trial (slotune/tuner/measure/trial_runner.py) alike.
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


def _run_warmup(engine, warmup: list[WorkloadRequest], params_for) -> None:
    # First-call allocations, caches and lazy compilation happen here, outside the measurement.
    for r in warmup:
        engine.add_request(r.request_id, r.prompt_token_ids, params_for(r))
    while engine.has_unfinished_requests():
        engine.step()


def run_in_process_replay(
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
) -> ReplayResult:
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
        ReplayResult: `metrics` (flat floats: latency percentiles, throughput, goodput, engine
        stats, peak memory) and per-request `records`.
    """
    from slotune.engine import LLM, SamplingParams  # imports torch: only an in-process replay needs it
    from slotune.engine.llm_engine import RequestRejected  # imports torch, as the line above

    llm = llm or LLM(cfg)
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise ValueError("run_in_process_replay needs an idle engine: it has unfinished requests")

    def params_for(r: WorkloadRequest) -> SamplingParams:
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
    next_req: WorkloadRequest | None = next(stream, None)
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
    return ReplayResult(
        config=llm.config.model_dump(mode="json"),
        workload=workload.model_dump(mode="json"),
        metrics=metrics,
        records=records,
        early_stopped=is_early,
        device=str(engine.runner.device),
        started_at=started_at,
    )


def load_tokenizer(model: str):
    """The tokenizer of a model reference as `EngineConfig.model` takes it, without the weights."""
    # engine.loader imports torch (it also reads weights): only `tune bench --url` pays for it here.
    from slotune.engine.loader import resolve_model_path
    from slotune.engine.tokenizer import Tokenizer

    return Tokenizer.from_model_path(resolve_model_path(model))
