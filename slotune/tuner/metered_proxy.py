"""`tune serve BEST.yaml` of an external server: the server on a loopback port behind a proxy that
times every request as `tune serve` does, so a canary of llama-server is judged on the same
histograms (slotune/operator/metrics.py) as one of the bundled engine.

The proxy answers /health (the server process is alive), /ready (the engine file's ready path
answers 200), /metrics (slotune's TTFT/TPOT/e2e histograms, then the server's own /metrics) and
forwards everything else. TTFT and TPOT are timed on streamed answers (first and last chunk that
carries text; tokens from the final chunk's usage when the server sends it); a non-streamed answer
counts in e2e only, since its first token is not seen. The server is tied to this process (it dies
with it); when the server ends, the proxy exits 1 so the pod restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest

from slotune.engine.serving.api_protocol import UNAUTHORIZED, bearer_matches
from slotune.engine.serving.event_loop import run as run_loop
from slotune.engine.serving.serving_metrics import ServingMetrics
from slotune.tuner.measure.external_server import ExternalServer, ServerFailure
from slotune.tuner.measure.http_stream import has_text
from slotune.tuner.spec.server import ServerConfig

TIMED_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class StreamTimer:
    """Times one streamed answer from its SSE lines."""

    def __init__(self, start: float) -> None:
        self.start, self.first, self.last = start, None, None
        self.chunks, self.tokens = 0, None
        self._pending = b""

    def feed(self, data: bytes, now: float) -> None:
        lines = (self._pending + data).split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            with contextlib.suppress(ValueError):
                event = json.loads(line[5:])
                if any(has_text(c) for c in event.get("choices") or []):
                    self.first = self.first if self.first is not None else now
                    self.last, self.chunks = now, self.chunks + 1
                usage = event.get("usage") or {}
                if isinstance(usage.get("completion_tokens"), int):
                    self.tokens = usage["completion_tokens"]

    def observe(self, metrics: ServingMetrics, end: float) -> None:
        metrics.e2e.observe(end - self.start)
        if self.first is None:
            return
        metrics.ttft.observe(self.first - self.start)
        tokens = self.tokens or self.chunks
        if tokens > 1:
            metrics.tpot.observe((self.last - self.first) / (tokens - 1))
        metrics.generation_tokens.inc(tokens)


def build_app(server: ExternalServer, metrics: ServingMetrics, api_key: str | None):
    """The proxy app in front of the started `server`."""
    upstream, ready_path = server.url, server.engine.ready_path
    key = api_key.encode() if api_key is not None else None

    async def session(app: web.Application) -> object:
        # a connection per request: a kept-alive one the server has since closed fails the next request
        app["client"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )
        yield
        await app["client"].close()

    async def health(_: web.Request) -> web.Response:
        alive = server.proc is not None and server.proc.poll() is None
        return web.json_response({"status": "ok" if alive else "server ended"}, status=200 if alive else 500)

    async def ready(request: web.Request) -> web.Response:
        try:
            async with request.app["client"].get(upstream + ready_path, timeout=aiohttp.ClientTimeout(5)) as r:
                ok = r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        return web.json_response({"status": "ready" if ok else "not ready"}, status=200 if ok else 503)

    async def prometheus(request: web.Request) -> web.Response:
        text = generate_latest(metrics.registry).decode()
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with request.app["client"].get(upstream + "/metrics", timeout=aiohttp.ClientTimeout(5)) as r:
                if r.status == 200:
                    text += await r.text()
        return web.Response(text=text, content_type="text/plain")

    async def forward(request: web.Request) -> web.StreamResponse:
        if key is not None and request.path.startswith("/v1/"):
            if not bearer_matches(request.headers.get("Authorization", "").encode(), key):
                metrics.rejected.labels("unauthorized").inc()
                metrics.observe_status(401)
                return web.json_response(UNAUTHORIZED, status=401)
        start = time.perf_counter()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS | {"authorization"}}
        body = await request.read()
        try:
            upstream_resp = await request.app["client"].request(
                request.method, upstream + request.rel_url.path_qs, data=body, headers=headers
            )
        except aiohttp.ClientError as exc:
            metrics.observe_status(502)
            return web.json_response({"error": {"message": f"server unreachable: {exc}"}}, status=502)
        async with upstream_resp:
            timed = request.method == "POST" and request.path in TIMED_PATHS and upstream_resp.status == 200
            out = web.StreamResponse(status=upstream_resp.status)
            for k, v in upstream_resp.headers.items():
                if k.lower() not in _HOP_HEADERS:
                    out.headers[k] = v
            await out.prepare(request)
            timer = StreamTimer(start) if timed else None
            async for data in upstream_resp.content.iter_any():
                if timer is not None:
                    timer.feed(data, time.perf_counter())
                await out.write(data)
            await out.write_eof()
        metrics.observe_status(upstream_resp.status)
        if timer is not None:
            timer.observe(metrics, time.perf_counter())
        return out

    app = web.Application(client_max_size=64 * 2**20)
    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", prometheus)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def serve_metered(cfg: ServerConfig, host: str, port: int, api_key: str | None) -> None:
    """Start `cfg`'s server on a loopback port and serve the proxy on host:port until SIGTERM/SIGINT
    (exit 0) or until the server ends (exit 1, with its reason)."""
    binary = cfg.resolved_binary()
    if binary is None:
        raise ValueError(
            f"`{cfg.binary or cfg.description().binary}` is not on PATH; install {cfg.engine} or set binary"
        )
    log = Path(tempfile.mkdtemp(prefix="slotune-serve-")) / f"{cfg.engine}.log"
    server = ExternalServer(
        cfg.description(),
        cfg.knobs,
        binary=binary,
        model=cfg.model_file(),
        tokenizer=None,
        log_path=log,
        ready_timeout_s=600.0,
    )
    print(f"starting {cfg.engine} (log: {log})", file=sys.stderr, flush=True)
    try:
        with server:
            print(f"launched: {' '.join(server.argv)}", file=sys.stderr, flush=True)
            code = run_loop(_serve(build_app(server, ServingMetrics(), api_key), host, port, server))
    except ServerFailure as exc:
        print(f"{cfg.engine}: {exc.reason}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    raise SystemExit(code)


async def _serve(app: web.Application, host: str, port: int, server: ExternalServer) -> int:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(
        f"serving on http://{host}:{port} (metered; {server.engine.name} at {server.url})", file=sys.stderr, flush=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        try:
            server.check()
        except ServerFailure as exc:
            print(f"{server.engine.name} ended: {exc.reason}", file=sys.stderr, flush=True)
            code = 1
            break
    await runner.cleanup()
    return code
