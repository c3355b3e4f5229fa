"""The server a served trial measures: what a trial needs from it, and the bundled engine behind it.

Lifecycle, as `trial_runner` drives it:
    with server:                      # start; __enter__ returns once it answers on `url`
        server.url, server.tokenizer  # where the client sends requests; how it tokenizes prompts
        server.begin_window()         # the client's warm-up is done, nothing in flight: count from here
        server.sample()               # about every 0.1 s while the client replays
    server.window_metrics()           # what the server saw over the window (engine counters, memory)
    server.check()                    # raises when the server died while serving
Latency and throughput always come from the client; a server that cannot see its engine's
counters returns {} from `window_metrics`. `is_hopeless` says the server stopped in-flight work
that could no longer meet the SLO (early stop).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

from slotune.engine.config import EngineConfig
from slotune.tuner.measure.in_process_replay import EngineWindow
from slotune.tuner.spec.slo import certain_violations


class TrialServer(Protocol):
    url: str
    tokenizer: Any  # engine.tokenizer.Tokenizer: the client tokenizes prompts exactly as the server does
    load_time_s: float  # from start to ready

    def __enter__(self) -> TrialServer: ...

    def __exit__(self, *exc: object) -> None: ...

    def begin_window(self) -> None: ...

    def sample(self) -> None: ...

    def window_metrics(self) -> dict[str, float]: ...

    def check(self) -> None: ...

    @property
    def is_hopeless(self) -> bool: ...


class BundledServer:
    """slotune's own engine served as `tune serve` serves it (AsyncLLM + the OpenAI app) on a free
    loopback port, in this process; `llm` is the loaded engine (the quality gates run on it after)."""

    def __init__(self, cfg: EngineConfig, objective: dict[str, Any], early_stop: dict[str, Any]) -> None:
        self.cfg, self.objective, self.early_stop = cfg, objective, early_stop
        self.url, self.tokenizer, self.llm, self.load_time_s = "", None, None, 0.0
        self._served = None
        self._stack = contextlib.ExitStack()
        self._window: EngineWindow | None = None
        self._watchdog: InFlightWatchdog | None = None

    def __enter__(self) -> BundledServer:
        from slotune.engine.serving.async_llm import AsyncLLM  # the serving stack: only a served trial needs it
        from slotune.engine.serving.server import build_app, serve_in_thread  # imports the engine, hence torch

        t0 = time.perf_counter()
        self._served = AsyncLLM(self.cfg)  # the server's engine thread loads it (slotune/engine/serving/async_llm.py)
        try:
            self.url = self._stack.enter_context(serve_in_thread(self._served, build_app(self._served)))
            self.load_time_s = time.perf_counter() - t0
            self.llm = self._served.llm
            self.tokenizer = self.llm.tokenizer
            if self.early_stop.get("enabled"):
                self._watchdog = InFlightWatchdog(self.llm.engine, self.objective, self.early_stop)
        except BaseException:  # nothing of the server outlives a failed start
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._watchdog is not None:
                self._watchdog.uninstall()
        finally:
            self._stack.close()

    def begin_window(self) -> None:
        self._window = EngineWindow(self.llm.engine)
        if self._watchdog is not None:  # installed after the warm-up: HTTP request ids do not mark it
            self._watchdog.install()

    def sample(self) -> None:
        if self._window is not None:
            self._window.sample()

    def window_metrics(self) -> dict[str, float]:
        return self._window.metrics() if self._window is not None else {}

    def check(self) -> None:
        error = self._served.error if self._served is not None else None
        if error is not None:
            raise RuntimeError(f"the engine loop died while serving: {type(error).__name__}: {error}")

    @property
    def is_hopeless(self) -> bool:
        return self._watchdog is not None and self._watchdog.is_hopeless


class InFlightWatchdog:
    """Early stop for requests that have not finished yet.

    The replay asks `should_stop` only when a request finishes; a static batch or a long
    prefill can keep that from happening for minutes while the SLO is already lost. This is an
    engine step hook: once `min_requests` in-flight requests are certain to miss a limit by
    `factor` x, it aborts everything in flight. In process, the aborted outputs reach
    `should_stop`, which then ends the replay as early-stopped; served, they reach the client as
    aborted streams, which end its replay, and the trial reads `is_hopeless`.
    """

    def __init__(self, engine, objective: dict[str, Any], es: dict[str, Any]) -> None:
        self.engine, self.objective, self.es = engine, objective, es
        self.is_hopeless = False
        self._remove = None

    def install(self) -> None:
        self._remove = self.engine.add_step_hook(self._check)

    def uninstall(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def _check(self, engine, outputs) -> list | None:
        if self.is_hopeless or not (self.objective.get("ttft_limit_s") or self.objective.get("tpot_limit_s")):
            return None
        seqs = [q for q in engine.seqs.values() if not q.request_id.startswith("warmup-")]
        if certain_violations(seqs, time.perf_counter(), self.objective, self.es["factor"]) < self.es["min_requests"]:
            return None
        self.is_hopeless = True
        done = {o.request_id for o in outputs if o.finished}
        return [o for rid in list(engine.seqs) if rid not in done for o in [engine.abort_request(rid)] if o is not None]
