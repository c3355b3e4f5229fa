"""One replay over HTTP: each request streamed (SSE) and timed on the client's clock (TTFT, TPOT, ITLs)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import aiohttp
from slotune.tuner.measure.metrics import RequestRecord
from slotune.tuner.workload.requests import WorkloadRequest

APIS = ("completions", "chat")


def has_text(choice: dict) -> bool:
    """Does this streamed choice carry generated text (completions `text`, chat `delta.content`)?"""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return bool(delta and (delta.get("content") or delta.get("reasoning_content")))


def split_itls(token_times: list[float], num_tokens: int) -> list[float]:
    """Inter-token latencies from text-chunk arrival times, given the true token count.

    Args:
        token_times: arrival time of each chunk that carried text.
        num_tokens: tokens generated (from usage); may exceed len(token_times).
    Returns:
        The gaps between chunks; when tokens outnumber chunks, each later chunk is given
        (num_tokens - 1) // (chunks - 1) tokens (the first ones one more, for the remainder) and
        its gap is split evenly over them, so the result has num_tokens - 1 values.
    """
    gaps = [b - a for a, b in zip(token_times, token_times[1:])]
    num_later = num_tokens - 1  # tokens after the first, which the first text chunk carried
    if not gaps or num_later <= len(gaps):
        return gaps
    base, rem = divmod(num_later, len(gaps))
    out: list[float] = []
    for i, gap in enumerate(gaps):
        n = base + (i < rem)
        out.extend([gap / n] * n)
    return out


async def _join(tasks: list[asyncio.Task]) -> None:
    """Wait for tasks; cancelled ones (an early stop) are fine, a real exception is re-raised."""
    for res in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(res, Exception):  # CancelledError is a BaseException, not an Exception
            raise res


class StreamReplay:
    """One run over one client: sends requests, turns streams into records, stops early.

    Lifecycle: `warm_up` (results discarded) -> `closed_loop` or `open_loop` (records kept) ->
    read `records`, `causes`, `is_early`. Every request runs in a task in `tasks`, so an early
    stop can cancel the ones in flight: cancelling closes their streams, and a server that
    watches for disconnects (ours does) aborts them and frees their KV cache.
    """

    def __init__(
        self,
        client: aiohttp.ClientSession,
        base_url: str,
        *,
        model: str,
        api: str,
        tokenizer,
        timeout_s: float,
        total: int | None,
        on_progress: Callable[[int, int | None], None] | None,
        should_stop: Callable[[list[RequestRecord]], bool] | None,
    ) -> None:
        self.client, self.base_url, self.model = client, base_url, model
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.is_chat = api == "chat"
        self.path = "/v1/chat/completions" if self.is_chat else "/v1/completions"  # below base_url
        self.total, self.on_progress, self.should_stop = total, on_progress, should_stop
        self.records: list[RequestRecord] = []
        self.causes: Counter[str] = Counter()
        self.num_resent = 0  # requests sent again after a pooled connection turned out closed
        self.num_short_outputs = 0
        self.tasks: set[asyncio.Task] = set()
        self.is_early = False
        self.t0 = time.perf_counter()

    # --- one request ----------------------------------------------------------------------
    def body(self, r: WorkloadRequest) -> dict[str, Any]:
        b: dict[str, Any] = {
            "model": self.model,
            "max_tokens": r.output_len,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        if self.is_chat:
            b["messages"] = [{"role": "user", "content": self.tokenizer.decode(r.prompt_token_ids)}]
        else:
            b["prompt"] = r.prompt_token_ids
        return b

    async def send(
        self, r: WorkloadRequest, body: dict[str, Any], arrival: float | None
    ) -> tuple[RequestRecord, str | None]:
        """Stream one request; returns its record and the failure cause (None if it completed).

        `arrival` None means now (closed loop: the send time).
        """
        times: list[float] = []  # arrival of each chunk that carried text
        usage: dict[str, Any] = {}
        reason: str | None = None
        cause: str | None = None
        is_done = False
        start = time.perf_counter()
        arrival = start if arrival is None else arrival
        deadline = start + self.timeout_s
        try:
            async with await self._post(body) as resp:
                if not 200 <= resp.status < 300:
                    await resp.read()  # drain the error body so the connection is reused
                    cause = str(resp.status)
                else:
                    async for line in resp.content:  # one SSE line per item, b"\n" (or b"\r\n") included
                        if not line.startswith(b"data:"):
                            continue  # blank separators, comments, event: lines
                        now = time.perf_counter()
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            is_done = True
                            break
                        chunk = json.loads(data)
                        if chunk.get("error") or chunk.get("object") == "error":  # vLLM, ours; older vLLM
                            cause = "stream_error"
                            break
                        choices = chunk.get("choices")
                        if choices:
                            choice = choices[0]  # we ask for n=1
                            if has_text(choice):
                                times.append(now)
                            reason = choice.get("finish_reason") or reason
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        if now > deadline:
                            cause = "timeout"
                            break
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            cause = "timeout"
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
            cause = "connection"  # refused, reset, or the body broke off mid-transfer
        except (aiohttp.ClientError, ValueError, AttributeError, TypeError):
            # undecodable body (JSONDecodeError, UnicodeDecodeError and an over-long line are
            # ValueErrors), or a chunk that is not the JSON shape we parse
            cause = "stream_error"
        end = time.perf_counter()
        if cause is None and reason is None and not is_done:
            cause = "incomplete"
        if cause is None and reason == "abort":
            cause = "abort"

        prompt_tokens = usage.get("prompt_tokens") or len(r.prompt_token_ids)
        if cause is not None:
            rec = RequestRecord(
                r.request_id,
                prompt_tokens,
                len(times),
                None,
                None,
                None,
                None,
                [],
                "rejected" if cause.isdigit() else "error",
                arrival_s=arrival - self.t0,
            )
            return rec, cause
        n = usage.get("completion_tokens")
        n = len(times) if n is None else int(n)
        finish = (
            reason
            if reason in ("stop", "length")
            else ("stop" if reason is not None else "length" if n >= r.output_len else "stop")
        )
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        rec = RequestRecord(
            r.request_id,
            prompt_tokens,
            n,
            ttft=times[0] - arrival if times else None,
            tpot=(times[-1] - times[0]) / (n - 1) if times and n > 1 else None,
            e2e=end - arrival,
            queue_time=None,
            itls=split_itls(times, n),
            finish_reason=finish,
            cached_prompt_tokens=int(cached),
            arrival_s=arrival - self.t0,
        )
        return rec, None

    async def _post(self, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """POST; sent again on another connection if it failed before any response byte came.

        Some servers answer `Keep-Alive` and then close the connection after a streamed response
        (llama.cpp's llama-server does), so the next request on that pooled connection fails while
        writing its body (ClientOSError) or finds the socket at EOF (ServerDisconnectedError):
        the server has not taken it. httpx retries that case by itself; aiohttp does not. A
        failure after the response started is never retried (it is counted as `connection`),
        the request's clock keeps its original start, so a retry's cost shows in its TTFT, and
        `num_resent` in the metrics counts the retries.
        """
        # Each failed try drops its stale connection from the pool, so at most pool-size + 1 tries.
        # A connection that cannot be opened at all (ClientConnectorError: the server is down)
        # is not retried.
        tries = (self.client.connector.limit or 64) + 1
        for attempt in range(tries):
            try:
                return await self.client.post(self.base_url + self.path, json=body)
            except aiohttp.ClientConnectorError:
                raise
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                if attempt == tries - 1:
                    raise
                self.num_resent += 1
        raise AssertionError("unreachable")

    # --- bookkeeping ----------------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def measure(self, r: WorkloadRequest, body: dict[str, Any], arrival: float | None) -> None:
        rec, cause = await self.send(r, body, arrival)
        self.records.append(rec)
        if cause is not None:
            self.causes[cause] += 1
        elif rec.output_tokens < r.output_len:
            self.num_short_outputs += 1  # the server ended early: it does not honour ignore_eos?
        if self.on_progress:
            self.on_progress(len(self.records), self.total)
        if self.should_stop and not self.is_early and self.should_stop(self.records):
            self.stop()

    def stop(self) -> None:
        """Early stop: send nothing more, cancel what is in flight (not recorded, as in-process)."""
        self.is_early = True
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()

    # --- the run --------------------------------------------------------------------------
    async def warm_up(self, warmup: list[WorkloadRequest]) -> None:
        # Connections, the server's first-call allocations and caches; results are discarded.
        await asyncio.gather(*(self.send(r, self.body(r), None) for r in warmup))

    async def closed_loop(self, stream: Iterator[WorkloadRequest], concurrency: int, end: float | None) -> None:
        async def worker() -> None:
            while not self.is_early:
                if end is not None and time.perf_counter() >= end:
                    return
                r = next(stream, None)
                if r is None:
                    return
                await self.measure(r, self.body(r), None)

        await _join([self.spawn(worker()) for _ in range(concurrency)])

    async def open_loop(self, stream: Iterator[WorkloadRequest]) -> None:
        async def launch() -> None:
            for r in stream:
                body = self.body(r)  # built before the wait, so it never delays the send
                arrival = self.t0 + r.arrival_offset_s
                delay = arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                self.spawn(self.measure(r, body, arrival))

        await _join([self.spawn(launch())])
        await _join(list(self.tasks))
