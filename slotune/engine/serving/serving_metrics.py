"""Prometheus metrics of one `tune serve` app, on its own registry (tests build several apps).

The names are a contract: the operator scrapes them to judge canaries. Add, never rename.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServingMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "slotune_time_to_first_token_seconds",
            "Time from admission to the first output token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "slotune_time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "slotune_e2e_request_latency_seconds",
            "Time from admission to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # prometheus_client appends _total: slotune_prompt_tokens_total etc.
        self.prompt_tokens = Counter("slotune_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("slotune_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "slotune_requests", "Requests that left the engine, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "slotune_requests_rejected", "Requests refused before reaching the engine loop", ["reason"], registry=r
        )
        self.http = Counter("slotune_http_responses", "HTTP responses by status class", ["status"], registry=r)
        self.running = Gauge("slotune_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("slotune_num_requests_waiting", "Requests waiting", registry=r)
        self.kv_used = Gauge("slotune_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_free = Gauge("slotune_kv_blocks_free", "KV blocks free", registry=r)
        self.prefix_hit = Gauge("slotune_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)", registry=r)
        self.spec_accept = Gauge("slotune_spec_decode_acceptance_rate", "Speculative draft acceptance rate", registry=r)
        # The engine loop's own time, cumulative (rate() of them: loop busy fraction, ms per step).
        self.steps = Counter("slotune_engine_steps", "Engine steps run", registry=r)
        self.step_seconds = Counter("slotune_engine_step_seconds", "Wall time inside engine steps", registry=r)
        self.execute_seconds = Counter(
            "slotune_engine_execute_seconds", "Wall time of the model forward inside engine steps", registry=r
        )
        self.step_tokens = Counter(
            "slotune_engine_step_tokens", "Tokens engine steps ran through the model", registry=r
        )
        self._last = (0, 0.0, 0.0, 0)
        # tune serve --record-traffic (slotune/engine/serving/traffic_recorder.py)
        self.traffic = Counter(
            "slotune_traffic_records",
            "Finished requests the traffic recorder handled, by outcome",
            ["outcome"],
            registry=r,
        )
        self._last_traffic = {"written": 0, "dropped": 0, "error": 0}

    def observe_finished(self, out) -> None:
        """Record a request the engine finished (stop/length) or aborted (client went away)."""
        m = out.metrics
        if out.finish_reason != "abort":
            for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e)):
                if value is not None:
                    hist.observe(value)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.output_token_ids))
        self.requests.labels(out.finish_reason or "unknown").inc()

    def refresh_recorder(self, recorder) -> None:
        now = {"written": recorder.num_recorded, "dropped": recorder.num_dropped, "error": recorder.num_errors}
        for outcome, n in now.items():
            self.traffic.labels(outcome).inc(max(n - self._last_traffic[outcome], 0))
        self._last_traffic = now

    def observe_status(self, status: int) -> None:
        self.http.labels(f"{status // 100}xx").inc()

    def refresh(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.num_total_blocks - stats.num_free_blocks)
        self.kv_free.set(stats.num_free_blocks)
        self.prefix_hit.set(stats.prefix_cache_hit_rate)
        self.spec_accept.set(stats.spec_acceptance_rate)
        now = (stats.num_steps, stats.step_seconds, stats.execute_seconds, stats.num_step_tokens)
        counters = (self.steps, self.step_seconds, self.execute_seconds, self.step_tokens)
        for counter, new, old in zip(counters, now, self._last):
            counter.inc(max(new - old, 0))
        self._last = now
