"""AsyncLLM: the engine loop in a background thread, streaming outputs into asyncio queues.

The loop thread owns the engine from loading and warm-up on, so every torch op runs in that one
thread: with libgomp each thread that runs a parallel region gets its own worker pool, and pools
that together hold more threads than there are cores slow every step (docs/design/engine-serving.md).
Requests and aborts go into an inbox the loop drains before every step (admission answers through
a future), so a handler waits at most one step and never on the lock. The loop never waits on the
network; each request's deltas go to its own asyncio.Queue via call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import threading
import time
from collections.abc import AsyncIterator

from slotune.engine.config import EngineConfig
from slotune.engine.outputs import RequestOutput
from slotune.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the server should report not-ready and restart."""


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, llm=None) -> None:
        self.config = config or EngineConfig()
        self._llm = llm
        self._lock = threading.Lock()  # held by the loop around drain + step; by others only when it is not running
        self._inbox: collections.deque = collections.deque()  # (fn, args, Future) run by the loop thread
        self._is_closed = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.is_ready = False
        self.is_accepting = True
        self.error: BaseException | None = None

    @property
    def engine(self):
        return self._llm.engine

    @property
    def tokenizer(self):
        return self._llm.tokenizer

    @property
    def llm(self):
        """The synchronous `LLM` under this server (None before `start`); usable once the loop stopped."""
        return self._llm

    async def start(self, warmup: bool = True) -> None:
        """Start the loop thread, which loads the model (unless one was given), warms up, then
        serves; returns once it serves. A load or warm-up error is raised here."""
        loop = asyncio.get_running_loop()
        started: asyncio.Future = loop.create_future()

        def report(exc: BaseException | None) -> None:
            def settle() -> None:
                if not started.done():
                    started.set_result(None) if exc is None else started.set_exception(exc)

            loop.call_soon_threadsafe(settle)

        self._thread = threading.Thread(target=self._run, args=(warmup, report), name="slotune-engine", daemon=True)
        self._thread.start()
        await started
        self.is_ready = True

    def _run(self, warmup: bool, report) -> None:
        try:
            if self._llm is None:
                from slotune.engine.llm import LLM  # imports torch, on the engine thread that owns the model

                self._llm = LLM(self.config)
            if warmup:
                self._llm.generate("Hello", SamplingParams(max_tokens=2))
        except BaseException as exc:
            self._is_closed = True
            report(exc)
            return
        report(None)
        self._loop()

    def _loop(self) -> None:
        engine = self._llm.engine
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before draining: a request queued after this sets it again
                with self._lock:
                    self._drain_inbox()
                    outputs = engine.step() if engine.has_unfinished_requests() else None
                if outputs is None:
                    self._wake.wait(0.05)
                    continue
                self._deliver_step(outputs)
        except BaseException as exc:  # surface to every waiter, never die silently
            self.error = exc
            self.is_ready = False
            for rid in list(self._queues):
                self._deliver_error(rid, exc)
        finally:
            self._is_closed = True
            self._fail_inbox()

    def _drain_inbox(self) -> None:
        while self._inbox:
            fn, args, fut = self._inbox.popleft()
            try:
                fut.set_result(fn(*args))
            except Exception as exc:  # RequestRejected etc. go back to the caller
                fut.set_exception(exc)

    def _fail_inbox(self) -> None:
        while True:
            try:
                _, _, fut = self._inbox.popleft()
            except IndexError:
                return
            fut.set_exception(EngineDeadError(f"engine loop stopped: {self.error!r}"))

    def _call_in_loop(self, fn, *args) -> concurrent.futures.Future:
        """Run fn(*args) on the loop thread before its next step."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.append((fn, args, fut))
        self._wake.set()
        if self._is_closed:  # the loop exited after we looked: nobody else will answer
            self._fail_inbox()
        return fut

    @property
    def _is_loop_running(self) -> bool:
        return self._thread is not None and not self._is_closed

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one hand-over per event loop: one wake-up of the HTTP loop per step,
        not one per sequence (each call_soon_threadsafe writes to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, out: RequestOutput) -> None:
        entry = self._queues.get(out.request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _deliver_error(self, rid: str, exc: BaseException) -> None:
        entry = self._queues.get(rid)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, exc)

    def _add(self, request_id: str, prompt: str | list[int], params: SamplingParams, arrival: float) -> None:
        with self._lock:
            self._llm.engine.add_request(request_id, prompt, params, arrival_time=arrival)
        self._wake.set()

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Admit a request (raises RequestRejected at once if admission refuses it)."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        if not self.is_accepting:
            raise RuntimeError("server is shutting down")
        rid = request_id or f"req-{next(self._ids)}"
        arrival = time.perf_counter()
        if isinstance(prompt, str):  # tokenize here, not on the loop thread
            prompt = await asyncio.to_thread(self._llm.tokenizer.encode, prompt, True)  # with BOS where due
        self._queues[rid] = (asyncio.get_running_loop(), asyncio.Queue())
        try:
            if self._is_loop_running:
                await asyncio.wrap_future(
                    self._call_in_loop(self._llm.engine.add_request, rid, prompt, params, arrival)
                )
            else:
                await asyncio.to_thread(self._add, rid, prompt, params, arrival)
        except BaseException as exc:
            self._queues.pop(rid, None)
            if isinstance(exc, asyncio.CancelledError):  # the caller left; the loop may still admit it
                self.abort_nowait(rid)
            raise
        return rid

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield deltas until finished; if the consumer goes away, abort and free KV blocks."""
        _, q = self._queues[request_id]
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine loop died: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                # No await here: under cancellation (client disconnect) an await would raise
                # before the abort ran. The loop thread picks it up between steps.
                self.abort_nowait(request_id)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        rid = await self.add_request(prompt, params, request_id)
        stream = self.stream(rid)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # inner generators are not closed for us: run its abort now

    def _abort(self, request_id: str) -> None:
        with self._lock:
            self._llm.engine.abort_request(request_id)

    def abort_nowait(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        if self._is_loop_running:
            self._call_in_loop(self._llm.engine.abort_request, request_id)  # before the next step
        else:
            threading.Thread(target=self._abort, args=(request_id,), daemon=True).start()

    async def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        await asyncio.to_thread(self._abort, request_id)

    def stats(self):
        return self._llm.engine.stats()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to grace_s, abort the rest."""
        self.is_accepting = False
        deadline = time.monotonic() + grace_s
        while self._llm is not None and self._llm.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._llm is not None:
            with self._lock:
                for rid in list(self._llm.engine.seqs):
                    out = self._llm.engine.abort_request(rid)
                    if out is not None:
                        self._deliver(out)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        self.is_ready = False


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
