"""Tables printed to the terminal: a benchmark's result (`tune bench`) and a trace's summary (`tune workload fit`)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from slotune.tuner.measure.measurement import Measurement
from slotune.tuner.measure.metrics import LATENCY_SERIES, PERCENTILES, ReplayResult
from slotune.tuner.spec.slo import metric_key
from slotune.tuner.workload.fit import TraceSummary


def _fmt(v: float | None, scale: float = 1.0) -> str:
    if v is None:
        return "-"
    v *= scale
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _fmt_ci(m: Measurement, key: str, scale: float = 1.0) -> str:
    """The value, and its 95% interval when measured: '63.9 (61.2-66.0)'."""
    ci, text = m.interval(key), _fmt(m.get(key), scale)
    return text if ci is None else f"{text} ({_fmt(ci[0], scale)}-{_fmt(ci[1], scale)})"


def print_result(res: ReplayResult, title: str = "benchmark", percentiles: tuple[float, ...] = PERCENTILES) -> None:
    """Rich tables: latency percentiles (ms), then throughput, goodput, cost (with a price), engine
    stats and failures; the rates and costs with their 95% intervals when measured.

    Rows whose metric the run did not produce (engine stats over HTTP, cost without a price) are left out.
    """
    m = Measurement.from_dict(res.metrics)
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
    for key in sorted(
        k for k in m if k.startswith("num_failed_")
    ):  # by HTTP status or cause (slotune/tuner/measure/http_replay.py)
        s.add_row(f"  failed: {key.removeprefix('num_failed_')}", _fmt(m[key]))
    console.print(s)


def summary_table(s: TraceSummary, title: str = "trace"):
    """The capacity-planning numbers of a trace as rich renderables: lengths by percentile, then rates,
    burstiness, concurrency and prefix sharing (rich imported here: CLI output only)."""
    from rich.console import Group
    from rich.table import Table

    def num(v: float | None, fmt: str = ".3g") -> str:
        return "-" if v is None else format(v, fmt)

    lengths = Table(title=title)
    lengths.add_column("tokens")
    for c in ("p50", "p95", "p99", "mean", "min", "max"):
        lengths.add_column(c, justify="right")
    for label, st in (("prompt", s.prompt_tokens), ("output", s.output_tokens)):
        lengths.add_row(label, *(num(v, ".0f") for v in (st.p50, st.p95, st.p99, st.mean, st.min, st.max)))
    traffic = Table(show_header=False, box=None)
    for label, value in (
        ("requests", f"{s.num_requests} over {s.duration_s:.1f} s"),
        ("mean rate", f"{num(s.mean_rate)} req/s"),
        ("peak rate", f"{s.peak_rate_1s:.3g} req/s over 1 s, {s.peak_rate_10s:.3g} req/s over 10 s"),
        ("burstiness (inter-arrival CV)", f"{num(s.interarrival_cv, '.2f')} (Poisson: 1)"),
        ("peak concurrency", f"{s.peak_concurrency} ({s.concurrency_source})"),
        (
            "cacheable-prefix share",
            num(s.cacheable_share, ".1%")
            + (f" (blocks of {s.block_size} tokens)" if s.block_size else " (no hash ids)"),
        ),
        ("cached share (served)", num(s.cached_share, ".1%")),
        ("chat share", num(s.chat_share, ".0%")),
        ("no-output requests", str(s.num_zero_output)),
    ):
        traffic.add_row(label, value)
    return Group(lengths, traffic)
