"""Replay a workload against any OpenAI-compatible endpoint and measure it (`tune bench --url`).

The same `WorkloadSpec` in and the same `BenchResult` out as the in-process bench
(tuner/bench.py), measured on the client's clock, so `tune serve`, llama.cpp's llama-server
and vLLM are compared on equal terms. Every request streams (SSE) greedy output with
`ignore_eos` and `max_tokens = output_len`, so the workload, not the model, decides how long
each answer is. `api="completions"` sends the prompt as token ids (exact prompt lengths);
`api="chat"` sends the decoded text as one user message, and the server's chat template adds
its own tokens (the record's prompt_tokens then come from the server's `usage`).

Per request, on `time.perf_counter`:
  arrival        the scheduled arrival (open loop) or the send time (closed loop), so waiting
                 for the server counts in TTFT, as in the in-process bench
  ttft           first chunk carrying text - arrival (the role-only chat opener and a final
                 text-less finish chunk carry no token)
  output_tokens  the final `usage.completion_tokens` when the server sends it, else the number
                 of text chunks
  tpot           (last text chunk - first text chunk) / (output_tokens - 1)
  itls           gaps between consecutive text chunks; a chunk may carry several tokens
                 (speculative decoding, a token whose text only completes with the next), so when
                 usage reports more tokens than chunks, the output_tokens - 1 tokens after the
                 first are spread over the later chunks as evenly as whole numbers allow and each
                 gap is split evenly over its chunk's tokens (the ITLs then sum to last - first)
  e2e            end of the stream - arrival
  queue_time     None: the server's queue is not visible over HTTP

Failures are recorded, never dropped and never retried (a 429 is a result, not a retry):
  finish_reason "rejected"  the server answered with a non-2xx status (429 overload, 401 key, ...)
  finish_reason "error"     the request broke: connection error, timeout, an error object or
                            malformed JSON in the stream, a stream that ended without [DONE] or a
                            finish_reason, or a server-side abort
and each is counted by cause as `num_failed_<cause>`: the HTTP status (`num_failed_429`), or
`connection`, `timeout`, `stream_error`, `incomplete`, `abort`; `num_failed` is their sum.

The client is built to sit beside the server it measures on a small machine: one aiohttp
session (its HTTP parser is C) on uvloop (`engine/serving/event_loop.py`) with HTTP/1.1
keep-alive connections, SSE parsed line by line with `json.loads` only on `data:` lines, nothing
logged per token. `client_cpu_s` reports what the measurement itself cost. Client CPU per
streamed chunk against a bare ASGI SSE server on the 2-core AVX2 EPYC (2026-11-24, medians of 3):
httpx 350 us at 1 stream / 170 us at 16, aiohttp 171 / 67 us; on two cores every client
microsecond is taken from the server it measures (twice over: bench/peers/colocated-*.md).

`python -m slotune.tuner.measure.http_replay IN.json OUT.json` (`main`) is a served trial's client process.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from slotune.engine.serving import event_loop
from slotune.tuner.measure.metrics import PERCENTILES, BenchResult, RequestRecord, breaks_slo_so_far, summarize
from slotune.tuner.spec.workload_spec import BenchRequest, WorkloadSpec, iter_requests

APIS = ("completions", "chat")
DEFAULT_TIMEOUT_S = 600.0


def _base_url(url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000' (paths below are /v1/...)."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"url: expected http(s)://host:port of an OpenAI-compatible server, got '{url}'")
    return base


def _has_text(choice: dict) -> bool:
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


class _Replay:
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
    def body(self, r: BenchRequest) -> dict[str, Any]:
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
        self, r: BenchRequest, body: dict[str, Any], arrival: float | None
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
                            if _has_text(choice):
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

    async def measure(self, r: BenchRequest, body: dict[str, Any], arrival: float | None) -> None:
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
    async def warm_up(self, warmup: list[BenchRequest]) -> None:
        # Connections, the server's first-call allocations and caches; results are discarded.
        await asyncio.gather(*(self.send(r, self.body(r), None) for r in warmup))

    async def closed_loop(self, stream: Iterator[BenchRequest], concurrency: int, end: float | None) -> None:
        async def worker() -> None:
            while not self.is_early:
                if end is not None and time.perf_counter() >= end:
                    return
                r = next(stream, None)
                if r is None:
                    return
                await self.measure(r, self.body(r), None)

        await _join([self.spawn(worker()) for _ in range(concurrency)])

    async def open_loop(self, stream: Iterator[BenchRequest]) -> None:
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


async def _served_models(client: aiohttp.ClientSession, base: str, *, is_required: bool) -> list[str]:
    """Model ids from GET /v1/models; a failed lookup is an error only when we need the id."""
    where = f"{base}/v1/models"
    ids: list[str] = []
    try:
        async with client.get(where) as resp:
            status = resp.status
            if 200 <= status < 300:
                try:
                    ids = [str(m["id"]) for m in (await resp.json(content_type=None))["data"]]
                except (ValueError, KeyError, TypeError):
                    ids = []
            else:
                await resp.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if is_required:
            raise ValueError(f"url: cannot reach {where} ({type(exc).__name__}: {exc})") from exc
        return []
    if is_required and not ids:
        hint = " (wrong or missing API key?)" if status == 401 else ""
        what = f"answered HTTP {status}{hint}" if not 200 <= status < 300 else "listed no model id"
        raise ValueError(f"url: GET {where} {what}; pass the model id explicitly (--model) to skip the lookup")
    return ids


async def _run(
    base: str,
    workload: WorkloadSpec,
    *,
    tokenizer,
    api_key: str | None,
    model: str | None,
    api: str,
    seed: int | None,
    timeout_s: float,
    metric_kw: dict[str, Any],
    on_progress,
    should_stop,
    after_warm_up,
) -> BenchResult:
    # Closed loop: one pooled keep-alive connection per worker. Open loop: no cap, or the
    # client's own queue for a connection would be measured as server TTFT.
    conc = workload.concurrency if workload.is_closed_loop else 0  # aiohttp: 0 = no limit
    connector = aiohttp.TCPConnector(limit=conc, limit_per_host=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No total limit (a long answer streams for long); connect and every read wait at most timeout_s.
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as client:
        served = await _served_models(client, base, is_required=model is None)
        model = model or served[0]
        replay = _Replay(
            client,
            base,
            model=model,
            api=api,
            tokenizer=tokenizer,
            timeout_s=timeout_s,
            total=workload.num_requests,
            on_progress=on_progress,
            should_stop=should_stop,
        )
        stream = iter_requests(workload, tokenizer, seed=seed)
        await replay.warm_up([next(stream) for _ in range(workload.warmup_requests)])
        if after_warm_up is not None:
            after_warm_up()  # may block: nothing is in flight, and the clock has not started

        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        cpu0 = time.process_time()
        replay.t0 = time.perf_counter()
        if workload.is_closed_loop:
            end = None if workload.duration_s is None else replay.t0 + workload.duration_s
            await replay.closed_loop(stream, workload.concurrency, end)
        else:
            await replay.open_loop(stream)
        duration = time.perf_counter() - replay.t0
        cpu_s = time.process_time() - cpu0

    metrics = summarize(replay.records, duration, **metric_kw)
    metrics["num_failed"] = float(sum(replay.causes.values()))
    for cause, n in sorted(replay.causes.items()):
        metrics[f"num_failed_{cause}"] = float(n)
    metrics["num_short_outputs"] = float(replay.num_short_outputs)
    metrics["num_resent"] = float(replay.num_resent)
    metrics["client_cpu_s"] = cpu_s
    return BenchResult(
        config={"url": base, "api": api, "model": model, "served_models": served},
        workload=workload.model_dump(mode="json"),
        metrics=metrics,
        records=replay.records,
        early_stopped=replay.is_early,
        device="http",
        started_at=started_at,
    )


def wait_ready(base_url: str, *, timeout_s: float = 120.0, proc=None, path: str = "/ready") -> None:
    """Block until GET base_url + path answers 200 (`tune serve`'s /ready: the engine is loaded).

    Args:
        proc: the server's `subprocess.Popen`, if this process started it: its exit ends the wait.

    Raises:
        RuntimeError: the server exited (with its code) or was not ready within timeout_s.
    """
    import httpx  # sync and light; this module's replay uses aiohttp

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before {path} answered")
        try:
            if httpx.get(base_url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{base_url}{path} not ready after {timeout_s:g} s")


def run_http_benchmark(
    url: str,
    workload: WorkloadSpec,
    *,
    tokenizer,
    api_key: str | None = None,
    model: str | None = None,
    api: str = "completions",
    ttft_limit_s: float | None = None,
    tpot_limit_s: float | None = None,
    seed: int | None = None,
    percentiles: tuple[float, ...] = (),
    on_progress: Callable[[int, int | None], None] | None = None,
    should_stop: Callable[[list[RequestRecord]], bool] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    after_warm_up: Callable[[], None] | None = None,
) -> BenchResult:
    """Replay `workload` against the OpenAI-compatible server at `url` and measure it.

    Args:
        url: the server's base URL (`http://host:port`, a trailing `/v1` is accepted).
        workload: arrivals, lengths, stop rule, seed; closed loop keeps `concurrency` requests in
            flight, open loop sends each at its arrival time whatever is in flight.
        tokenizer: the served model's tokenizer (`encode`, `decode`, `apply_chat_template`):
            it turns the workload into token ids, exactly as for the in-process bench.
        api_key: sent as `Authorization: Bearer KEY`.
        model: the model id to request; None asks GET /v1/models and takes the first.
        api: "completions" (token-id prompts to /v1/completions) or "chat" (decoded text as one
            user message to /v1/chat/completions; needs a workload with mode 'completion').
        ttft_limit_s, tpot_limit_s: per-request limits for goodput / SLO attainment.
        seed: overrides `workload.seed`.
        percentiles: extra pXX to report besides 50/90/95/99.
        on_progress: called with (recorded, total) after each measured request, failed ones too;
            total is None for a duration-bounded run.
        should_stop: called with the records so far after each; True stops sending, cancels
            the requests in flight (closing their streams; they are not recorded) and marks
            the result `early_stopped`.
        timeout_s: a request still streaming this long after it was sent, or waiting this long
            for a byte, is cut off and recorded as a timeout.
        after_warm_up: called once the warm-up requests have finished, before the measured run
            starts its clock; it may block (a trial snapshots the server's engine counters here).
    Returns:
        BenchResult with device "http", config {url, api, model, served_models}, the metrics of
        `summarize` plus num_failed, num_failed_<cause>, num_short_outputs (completed with fewer
        tokens than asked: the server ignored ignore_eos) and client_cpu_s, and the records.
    Raises:
        ValueError: a bad url/api, api='chat' with a chat-mode workload, or (model None) a
            server whose /v1/models cannot be read.
    """
    if api not in APIS:
        raise ValueError(f"api: must be one of {', '.join(APIS)}, got '{api}'")
    if api == "chat" and workload.mode == "chat":
        raise ValueError(
            "api: 'chat' sends the prompt as a user message for the server's chat template, but "
            f"workload '{workload.name}' has mode 'chat' (its prompts are templated already); "
            "use api 'completions' to send them as token ids"
        )
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
    base = _base_url(url)
    metric_kw = {
        "ttft_limit_s": ttft_limit_s,
        "tpot_limit_s": tpot_limit_s,
        "percentiles": tuple(dict.fromkeys((*PERCENTILES, *percentiles))),
    }
    return event_loop.run(
        _run(
            base,
            workload,
            tokenizer=tokenizer,
            api_key=api_key,
            model=model,
            api=api,
            seed=seed,
            timeout_s=timeout_s,
            metric_kw=metric_kw,
            on_progress=on_progress,
            should_stop=should_stop,
            after_warm_up=after_warm_up,
        )
    )


def main(argv: list[str]) -> int:
    """`python -m slotune.tuner.measure.http_replay IN.json OUT.json`: a trial's client, in its own process.

    A served trial (tuner/trial_runner.py) serves the config under test as `tune serve` does and
    runs this as its client, as a real client runs: another process, loopback HTTP.

    IN.json: url; workload (a WorkloadSpec dict); tokenizer_file (the served engine's Tokenizer,
    pickled by the trial: prompts are tokenized exactly as the server does, and unpickling took
    0.4 s without importing torch, where `load_tokenizer` from the GGUF took 6-11 s on the
    2-core box); seed; objective (percentile and limits, as in a trial request); early_stop
    ({enabled, min_requests, factor}); optional phase_file (progress, 'replay 5/48') and
    warm_file. With warm_file, the client creates that file once its warm-up has finished and
    waits for a line on stdin before it starts the clock, so the trial can snapshot the engine's
    counters in between; stdin closing (the trial died) ends this process.
    OUT.json: {"status": "ok", "result": BenchResult dict} or {"status": "error", "error": ...}.

    Early stop: the trial's rule on the requests finished so far (`breaks_slo_so_far`), and at
    the first request that broke (finish_reason "error"): over loopback to our own server that
    is the trial's in-flight watchdog aborting hopeless requests, or the engine dying; the
    trial, which sees the engine, tells the two apart.
    """
    src, dst = Path(argv[0]), Path(argv[1])
    req = json.loads(src.read_text())
    phase_file, warm_file = req.get("phase_file"), req.get("warm_file")
    objective, es = req["objective"], req.get("early_stop") or {}

    def phase(text: str) -> None:
        if phase_file:
            tmp = f"{phase_file}.{os.getpid()}.tmp"  # the trial writes the same file with its own tmp
            Path(tmp).write_text(text)
            os.replace(tmp, phase_file)

    def exit_when_stdin_closes() -> None:
        sys.stdin.readline()  # the trial never writes again: this returns only at EOF
        os._exit(2)  # the trial is gone; nobody will read our result

    def wait_for_go() -> None:
        Path(warm_file).touch()
        if not sys.stdin.readline():
            os._exit(2)  # the trial died during our warm-up
        threading.Thread(target=exit_when_stdin_closes, daemon=True).start()

    def should_stop(records: list[RequestRecord]) -> bool:
        if records[-1].finish_reason == "error":
            return True
        return bool(es.get("enabled")) and breaks_slo_so_far(records, objective, es)

    try:
        tokenizer = pickle.loads(Path(req["tokenizer_file"]).read_bytes())
        phase("client: warm-up")
        res = run_http_benchmark(
            req["url"],
            WorkloadSpec.model_validate(req["workload"]),
            tokenizer=tokenizer,
            ttft_limit_s=objective.get("ttft_limit_s"),
            tpot_limit_s=objective.get("tpot_limit_s"),
            seed=req.get("seed"),
            percentiles=(objective["percentile"],),
            on_progress=lambda done, total: phase(f"replay {done}/{total}"),
            should_stop=should_stop,
            after_warm_up=wait_for_go if warm_file else None,
        )
        out = {"status": "ok", "result": res.to_dict()}
    except Exception as exc:  # reported by the trial as its failure reason
        out = {"status": "error", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
    dst.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through subprocesses
    sys.exit(main(sys.argv[1:]))
