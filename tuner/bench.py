"""Replay a workload against the engine in-process and measure it (`tune bench`).

Open-loop arrivals are passed to the engine as the *scheduled* arrival time, so time spent
queueing because the engine is busy counts in TTFT, as a user would see it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotune.tuner.metrics import RequestRecord, summarize
from slotune.tuner.workload import WorkloadSpec, generate_requests


@dataclass
class BenchResult:
    config: dict[str, Any]
    workload: dict[str, Any]
    metrics: dict[str, float]
    records: list[RequestRecord] = field(default_factory=list)
    early_stopped: bool = False
    device: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config, "workload": self.workload, "metrics": self.metrics,
            "records": [r.to_dict() for r in self.records], "early_stopped": self.early_stopped,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BenchResult":
        return cls(d["config"], d["workload"], d["metrics"], [RequestRecord(**r) for r in d.get("records", [])],
                   d.get("early_stopped", False), d.get("device", ""))


def _record(out) -> RequestRecord:
    m = out.metrics
    return RequestRecord(
        request_id=out.request_id, prompt_tokens=len(out.prompt_token_ids), output_tokens=len(out.output_token_ids),
        ttft=m.ttft, tpot=m.tpot, e2e=m.e2e, queue_time=m.queue_time, itls=m.itls,
        finish_reason=out.finish_reason, cached_prompt_tokens=m.num_cached_prompt_tokens,
    )


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_benchmark(cfg, workload: WorkloadSpec, *, llm=None, ttft_limit_s: float | None = None,
                  tpot_limit_s: float | None = None, seed: int | None = None,
                  on_progress: Callable[[int, int], None] | None = None,
                  should_stop: Callable[[list[RequestRecord]], bool] | None = None) -> BenchResult:
    """Replay `workload` on an engine built from `cfg` (or the given `llm`) and measure it.

    Args:
        cfg: the EngineConfig to measure.
        workload: arrivals, lengths, seed.
        llm: reuse a loaded engine (its config must equal cfg).
        ttft_limit_s, tpot_limit_s: per-request limits for goodput / SLO attainment.
        seed: overrides workload.seed (robustness re-measurement).
        on_progress: called with (completed, total) as requests finish.
        should_stop: called with the records so far after each completion; True stops the
            run early (a hopeless trial) and marks the result `early_stopped`.
    Returns:
        BenchResult with flat `metrics` and per-request `records`.
    """
    from slotune.engine import LLM, SamplingParams
    from slotune.engine.llm_engine import RequestRejected

    llm = llm or LLM(cfg)
    engine = llm.engine
    reqs = generate_requests(workload, llm.tokenizer, seed=seed)
    warm = [r for r in reqs if r.request_id.startswith("warmup-")]
    reqs = [r for r in reqs if not r.request_id.startswith("warmup-")]
    for r in warm:  # warm-up: first-call allocations and caches, excluded from metrics
        llm.generate(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
    peak_blocks_before = engine.block_manager.peak_blocks_used
    engine.block_manager.peak_blocks_used = engine.block_manager.num_used_blocks
    stats0 = engine.stats()

    closed = workload.arrivals == "closed_loop"
    pending = list(reqs)
    records: list[RequestRecord] = []
    in_flight = 0
    early = False
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter()
        while pending and (in_flight < workload.concurrency if closed else t0 + pending[0].arrival_offset_s <= now):
            r = pending.pop(0)
            arrival = now if closed else t0 + r.arrival_offset_s
            try:
                engine.add_request(r.request_id, r.prompt_token_ids,
                                   SamplingParams(max_tokens=r.output_len, ignore_eos=True), arrival_time=arrival)
                in_flight += 1
            except RequestRejected:
                records.append(RequestRecord(r.request_id, len(r.prompt_token_ids), 0, None, None, None, None, [], "rejected"))
        if not engine.has_unfinished_requests():
            if pending:  # idle until the next open-loop arrival
                time.sleep(max(0.0, t0 + pending[0].arrival_offset_s - time.perf_counter()))
            continue
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                records.append(_record(out))
                if on_progress:
                    on_progress(len(records), len(reqs))
                if should_stop and should_stop(records):
                    early = True
        if early:
            for rid in list(engine.seqs):
                engine.abort_request(rid)
            break
    duration = time.perf_counter() - t0
    metrics = summarize(records, duration, ttft_limit_s=ttft_limit_s, tpot_limit_s=tpot_limit_s)
    st = engine.stats()
    metrics["peak_kv_blocks"] = float(engine.block_manager.peak_blocks_used)
    metrics["num_kv_blocks"] = float(st.num_total_blocks)
    q = st.prefix_cache_queries - stats0.prefix_cache_queries
    metrics["prefix_cache_hit_rate"] = (st.prefix_cache_hits - stats0.prefix_cache_hits) / q if q else 0.0
    drafts = st.num_draft_tokens - stats0.num_draft_tokens
    acc = st.num_accepted_tokens - stats0.num_accepted_tokens
    metrics["spec_acceptance_rate"] = acc / drafts if drafts else 0.0
    metrics["num_preemptions"] = float(st.num_preemptions - stats0.num_preemptions)
    metrics["num_rejected"] = float(sum(1 for r in records if r.finish_reason == "rejected"))
    metrics["weight_bytes"] = float(engine.weight_bytes)
    metrics["kv_bytes_per_token"] = float(engine.kv_bytes_per_token)
    device = str(engine.runner.device)
    metrics["peak_memory_mb"] = peak_memory_mb(device)
    engine.block_manager.peak_blocks_used = max(peak_blocks_before, engine.block_manager.peak_blocks_used)
    return BenchResult(config=llm.config.model_dump(mode="json"), workload=workload.model_dump(mode="json"),
                       metrics=metrics, records=records, early_stopped=early, device=device)


def print_result(res: BenchResult, title: str = "benchmark") -> None:
    from rich.console import Console
    from rich.table import Table

    m = res.metrics
    t = Table(title=f"{title} ({res.device}, {int(m['num_completed'])}/{int(m['num_requests'])} requests)")
    t.add_column("metric")
    for p in ("p50", "p90", "p95", "p99"):
        t.add_column(p, justify="right")
    for name, unit, scale in (("ttft", "ms", 1e3), ("tpot", "ms", 1e3), ("itl", "ms", 1e3), ("e2e", "s", 1), ("queue_time", "ms", 1e3)):
        t.add_row(f"{name} ({unit})", *[f"{m[f'{name}_{p}'] * scale:.1f}" if f"{name}_{p}" in m else "-" for p in ("p50", "p90", "p95", "p99")])
    Console().print(t)
    s = Table(show_header=False)
    for k in ("output_tokens_per_s", "requests_per_s", "goodput_rps", "peak_kv_blocks", "prefix_cache_hit_rate",
              "spec_acceptance_rate", "num_preemptions", "peak_memory_mb", "weight_bytes"):
        s.add_row(k, f"{m.get(k, 0):.3f}" if isinstance(m.get(k), float) and m.get(k, 0) < 1000 else f"{m.get(k, 0):,.0f}")
    Console().print(s)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects key=value (e.g. max_num_seqs=8), got '{item}'")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def bench_command(config: Path | None, workload: Path | None, json_out: Path | None, overrides: list[str],
                  seed: int | None) -> BenchResult:
    from slotune.engine.config import EngineConfig

    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    if overrides:
        cfg = cfg.with_updates(parse_overrides(overrides))
    wl = WorkloadSpec.load(workload if workload else "chat-small")
    res = run_benchmark(cfg, wl, seed=seed)
    print_result(res, title=f"tune bench: {wl.name}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res.to_dict(), indent=1))
    return res
