"""Replay a workload against any OpenAI-compatible endpoint and measure it (`tune bench --url`).

The same `WorkloadSpec` in and `ReplayResult` out as the in-process replay (in_process_replay.py),
on the client's clock, so `tune serve`, llama.cpp's llama-server and vLLM compare on equal terms.
Every request streams greedy output with `ignore_eos` and `max_tokens = output_len`, so the workload
decides each answer's length. Failures are recorded and counted by cause (`num_failed_<cause>`),
never dropped or retried. The client is lean (aiohttp on uvloop), because on a small machine its CPU
is taken from the server it measures. Per-request timing and client cost: docs/design/tuner-measure.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import aiohttp
from slotune.engine.serving import event_loop
from slotune.tuner.measure.http_stream import APIS, StreamReplay
from slotune.tuner.measure.metrics import PERCENTILES, ReplayResult, RequestRecord, summarize
from slotune.tuner.spec.workload_spec import WorkloadSpec
from slotune.tuner.workload.requests import iter_requests

DEFAULT_TIMEOUT_S = 600.0


def _base_url(url: str) -> str:
    """'http://host:8000/v1/' -> 'http://host:8000' (paths below are /v1/...)."""
    base = url.strip().rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"url: expected http(s)://host:port of an OpenAI-compatible server, got '{url}'")
    return base


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
) -> ReplayResult:
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
        replay = StreamReplay(
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
    return ReplayResult(
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


def run_http_replay(
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
) -> ReplayResult:
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
        ReplayResult with device "http", config {url, api, model, served_models}, the metrics of
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
