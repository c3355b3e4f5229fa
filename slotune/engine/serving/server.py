"""`tune serve`: OpenAI-compatible HTTP API over AsyncLLM (FastAPI + uvicorn).

The engine loop runs in its own thread; handlers only parse (api_protocol.parse_request),
tokenize (off the event loop), enqueue and await deltas. Admission failures map to 400 (never
fits) or 429 + Retry-After (overload); the server itself holds at most max_num_seqs +
admission.max_pending_requests requests, each from parsing to the end of its response, so
its queue is bounded by default. A client that disconnects, streaming or not, has its
sequence aborted at once, freeing its KV blocks. Prompt text never reaches the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from slotune.engine.serving.api_protocol import (
    ChatRequest,
    CompletionRequest,
    UNAUTHORIZED,
    InvalidRequest,
    _Request,
    bearer_matches,
    error_response,
    parse_request,
)
from slotune.engine.serving import event_loop
from slotune.engine.serving.async_llm import AsyncLLM, EngineDeadError
from slotune.engine.chat_template import ChatTemplateError
from slotune.engine.config import EngineConfig
from slotune.engine.llm_engine import RequestRejected
from slotune.engine.sampling_params import SamplingParams
from slotune.engine.serving.serving_metrics import ServingMetrics
from slotune.engine.serving.traffic_recorder import TrafficRecorder

log = logging.getLogger("slotune.server")
OVERLOAD_REASONS = {"queue_full", "tokens_in_flight"}
_UNAVAILABLE = {"Retry-After": "5"}


class _EventStream(StreamingResponse):
    """An SSE response whose `on_close` runs however it ends: finished, client gone, or never
    started (a client that leaves before the headers go out leaves the generator unstarted, and
    an unstarted generator's `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # a started stream aborts and frees its blocks now, not at GC
            finally:
                self.on_close()


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The rendered conversation's ids: the template writes its own BOS."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages))


class _Guard:
    """Pure-ASGI gate in front of /v1/*: API key, readiness, body size (also for chunked bodies).

    The body is read here, bounded, and replayed to the app; later receive() calls go to the
    server, so disconnect detection downstream still works.
    """

    def __init__(self, app, *, llm: AsyncLLM, metrics: ServingMetrics, api_key: str | None, max_body_bytes: int):
        self.app, self.llm, self.metrics = app, llm, metrics
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.observe_status(message["status"])
            await send(message)

        refusal = self._refusal(dict(scope["headers"]))
        if refusal is not None:
            return await refusal(scope, receive, counting_send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await self._too_large()(scope, receive, counting_send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, counting_send)

    def _too_large(self) -> JSONResponse:
        self.metrics.rejected.labels("body_too_large").inc()
        return error_response(413, f"request body exceeds {self.max_body_bytes} bytes", code="body_too_large")

    def _refusal(self, headers: dict[bytes, bytes]) -> JSONResponse | None:
        if self.api_key is not None:
            if not bearer_matches(headers.get(b"authorization", b""), self.api_key):
                self.metrics.rejected.labels("unauthorized").inc()
                return JSONResponse(UNAUTHORIZED, status_code=401)
        if not self.llm.is_accepting:
            self.metrics.rejected.labels("shutting_down").inc()
            return error_response(
                503, "server is shutting down", "unavailable", code="shutting_down", headers=_UNAVAILABLE
            )
        if not self.llm.is_ready:
            self.metrics.rejected.labels("not_ready").inc()
            return error_response(503, "model is not ready", "unavailable", code="not_ready", headers=_UNAVAILABLE)
        size = headers.get(b"content-length")
        if size is not None:
            if not size.isdigit():
                return error_response(400, "invalid Content-Length header")
            if int(size) > self.max_body_bytes:
                return self._too_large()
        return None


def build_app(
    llm: AsyncLLM,
    *,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = 1 << 20,
    retry_after_s: int = 1,
    recorder: TrafficRecorder | None = None,
) -> FastAPI:
    """The FastAPI app over a (possibly not yet started) AsyncLLM; /ready is 503 until it is.
    With a `recorder`, every request that reaches the engine is recorded when it leaves it."""
    app = FastAPI(title="slotune", docs_url=None, redoc_url=None, openapi_url=None)
    model_id = served_model_name or llm.config.model
    stream_interval = llm.config.stream_interval
    metrics = ServingMetrics()
    app.state.metrics = metrics
    app.state.llm = llm
    app.add_middleware(_Guard, llm=llm, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)

    def refuse(status: int, reason: str, message: str, param: str | None = None, **kw) -> JSONResponse:
        metrics.rejected.labels(reason).inc()
        return error_response(status, message, param=param, code=reason, **kw)

    adm = llm.config.admission
    max_requests = None if adm.max_pending_requests is None else llm.config.max_num_seqs + adm.max_pending_requests
    num_requests = 0  # held by handlers, parse to last byte; only the event loop touches it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error" if exc.status_code < 500 else "server_error",
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        log.error("unhandled %s on %s", type(exc).__name__, request.url.path)  # no message: it may quote input
        metrics.observe_status(500)  # this handler answers outside _Guard, which counts every other status
        return error_response(500, "internal server error", "server_error")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError):
        return error_response(
            503, "the engine loop has stopped; the server needs a restart", "unavailable", code="engine_dead"
        )

    @app.get("/health")
    async def health():
        if llm.error is not None:  # liveness fails: let the orchestrator restart us
            return error_response(
                500, f"engine loop died: {type(llm.error).__name__}", "server_error", code="engine_dead"
            )
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not llm.is_ready or not llm.is_accepting:
            return error_response(503, "not ready", "unavailable", headers=_UNAVAILABLE)
        return {"status": "ready"}

    @app.get("/metrics")
    async def prom():
        if llm.is_ready:
            metrics.refresh(llm.stats())
        if recorder is not None:
            metrics.refresh_recorder(recorder)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "slotune"}]}

    def sampling_params(req: _Request) -> SamplingParams | JSONResponse:
        if req.model != model_id:
            return refuse(
                404, "model_not_found", f"model '{req.model}' does not exist; this server serves '{model_id}'", "model"
            )
        if req.n != 1:
            return refuse(
                400, "unsupported_parameter", f"n={req.n} is not supported (only n=1); send separate requests", "n"
            )
        if (unsupported := req.unsupported_field()) is not None:
            name, message = unsupported
            return refuse(400, "unsupported_parameter", message, name)
        vocab_size = llm.engine.runner.model_cfg.vocab_size
        top_k = req.top_k if 0 < req.top_k < vocab_size else 0  # k >= vocab keeps every token: same as off
        return SamplingParams(
            max_tokens=req.num_max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=top_k,
            seed=req.seed,
            stop=req.stop,
            ignore_eos=req.ignore_eos,
        )

    async def admit(prompt: str | list[int], params: SamplingParams, rid: str) -> JSONResponse | None:
        try:
            await llm.add_request(prompt, params, rid)
        except RequestRejected as exc:
            if exc.reason in OVERLOAD_REASONS:
                return refuse(
                    429,
                    exc.reason,
                    f"server overloaded: {exc.message}; retry after {retry_after_s}s",
                    headers={"Retry-After": str(retry_after_s)},
                )
            return refuse(400, exc.reason, exc.message, "max_tokens" if "max_tokens" in exc.reason else "prompt")
        except EngineDeadError:
            raise
        except RuntimeError:
            if llm.is_accepting:
                raise
            return refuse(503, "shutting_down", "server is shutting down", headers=_UNAVAILABLE)
        return None

    def usage(out) -> dict[str, int]:
        p, c = len(out.prompt_token_ids), len(out.output_token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def handle(request: Request, chat: bool):
        """Parse, then respond while holding one of the server's `max_requests` places; a stream
        gives its place back when its response ends (`_EventStream.on_close`)."""
        nonlocal num_requests
        if max_requests is not None and num_requests >= max_requests:
            return refuse(
                429,
                "queue_full",
                f"server overloaded: {num_requests} requests in flight (max_num_seqs "
                f"{llm.config.max_num_seqs} + admission.max_pending_requests {adm.max_pending_requests}); "
                f"retry after {retry_after_s}s",
                headers={"Retry-After": str(retry_after_s)},
            )
        num_requests += 1
        is_handed_over = False

        def release() -> None:
            nonlocal num_requests
            num_requests -= 1

        try:
            try:
                req = parse_request(await request.body(), ChatRequest if chat else CompletionRequest)
            except InvalidRequest as exc:
                return refuse(400, exc.code, exc.message, exc.param)
            response = await respond(req, request, chat, release)
            is_handed_over = isinstance(response, _EventStream)
            return response
        finally:
            if not is_handed_over:
                release()

    async def respond(req: _Request, request: Request, chat: bool, release: Callable[[], None]):
        params = sampling_params(req)
        if isinstance(params, JSONResponse):
            return params
        if chat:
            try:
                messages = [m.as_template_input() for m in req.messages]
                prompt = await asyncio.to_thread(_chat_ids, llm.tokenizer, messages)
            except ChatTemplateError as exc:  # the model's template refuses this conversation (e.g. role order)
                return refuse(400, "invalid_request", f"messages: {exc}", "messages")
        else:
            prompt = req.prompt
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        refusal = await admit(prompt, params, rid)
        if refusal is not None:
            return refusal
        created = int(time.time())
        if req.stream:
            is_started = False

            def on_start() -> None:
                nonlocal is_started
                is_started = True

            def on_close() -> None:
                if not is_started:  # the client left before the first byte: nothing else aborts it
                    metrics.requests.labels("abort").inc()
                    llm.abort_nowait(rid)
                release()

            return _EventStream(
                sse(rid, created, chat, req.is_usage_streamed, on_start, req.max_tokens),
                on_close,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        last = await collect_or_abort(rid, request)
        if last is None:
            return error_response(499, "client closed request", "aborted")
        finished(last, chat, req.max_tokens)
        if last.finish_reason == "abort":
            return error_response(
                503,
                "server shut down before the request finished",
                "unavailable",
                code="shutting_down",
                headers=_UNAVAILABLE,
            )
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": last.text}, "finish_reason": last.finish_reason}
            if chat
            else {"index": 0, "text": last.text, "finish_reason": last.finish_reason, "logprobs": None}
        )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_id,
            "choices": [choice],
            "usage": usage(last),
        }

    async def collect_or_abort(rid: str, request: Request):
        """The final output, or None if the client left first (its sequence is then aborted)."""

        async def collect():
            stream, last = llm.stream(rid), None
            try:
                async for out in stream:
                    last = out
            finally:
                await stream.aclose()  # on cancel: abort + free blocks
            return last

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                metrics.requests.labels("abort").inc()
        with contextlib.suppress(asyncio.CancelledError):
            return await result
        return None

    def finished(last, chat: bool, max_tokens: int | None) -> None:
        metrics.observe_finished(last)
        if recorder is not None:
            recorder.record(last, chat=chat, max_tokens=max_tokens)

    async def sse(
        rid: str, created: int, chat: bool, include_usage: bool, on_start: Callable[[], None], max_tokens: int | None
    ):
        on_start()
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **extra) -> str:
            return (
                "data: "
                + json.dumps(
                    {"id": rid, "object": obj, "created": created, "model": model_id, "choices": choices, **extra}
                )
                + "\n\n"
            )

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": finish}

        stream, last = llm.stream(rid), None
        held, held_tokens, is_text_sent = [], 0, False  # text not sent yet, its tokens (stream_interval)
        try:
            if chat:
                yield event([choice(None, None, first=True)])
            async for out in stream:
                last = out
                held_tokens += len(out.new_token_ids)
                if out.new_text:
                    held.append(out.new_text)
                if out.finished or (held and (not is_text_sent or held_tokens >= stream_interval)):
                    yield event([choice("".join(held), out.finish_reason if out.finished else None)])
                    held, held_tokens, is_text_sent = [], 0, is_text_sent or bool(held)
            finished(last, chat, max_tokens)
            if include_usage:
                yield event([], usage=usage(last))
            yield "data: [DONE]\n\n"
        except EngineDeadError:
            yield (
                "data: "
                + json.dumps(
                    {
                        "error": {
                            "message": "the engine loop has stopped",
                            "type": "server_error",
                            "param": None,
                            "code": "engine_dead",
                        }
                    }
                )
                + "\n\n"
            )
        finally:
            if last is None or not last.finished:
                metrics.requests.labels("abort").inc()
            await stream.aclose()  # disconnect (GeneratorExit/cancel): abort + free blocks now

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


def _uvicorn_server(app: FastAPI, host: str, port: int, grace_s: float, log_level: str):
    """A uvicorn.Server that leaves signals alone: its owner decides when to drain and stop."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # SIGTERM drains first (serve_command); a thread owns no signals
            yield

    return _Server(
        uvicorn.Config(
            app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=int(grace_s) + 5
        )
    )


async def _serve(
    llm: AsyncLLM,
    server,
    *,
    stopping: asyncio.Event,
    forced: asyncio.Event,
    grace_s: float,
    on_ready: Callable[[], None],
) -> int:
    """Serve until `stopping`: uvicorn and `llm.start()` (load + warm-up) together; `on_ready` once
    both run; then stop accepting, drain in-flight requests for up to grace_s (`forced` cuts the
    drain short, aborting what is left) and stop uvicorn.

    Returns 0, or 1 when uvicorn stopped before serving (uvicorn logged why; a port that is taken
    raises uvicorn's SystemExit out of the loop instead).
    """
    serve_task = asyncio.create_task(server.serve())
    start_task = asyncio.create_task(llm.start())
    await asyncio.wait({serve_task, start_task}, return_when=asyncio.FIRST_COMPLETED)
    if serve_task.done():
        start_task.cancel()
        return 1
    await start_task
    while not server.started and not serve_task.done():  # the model may be ready before the socket
        await asyncio.sleep(0.01)
    if serve_task.done():
        await llm.shutdown(grace_s=0)
        return 1
    on_ready()
    stop_wait = asyncio.create_task(stopping.wait())
    await asyncio.wait({serve_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    drain = asyncio.create_task(llm.shutdown(grace_s=grace_s))
    force_wait = asyncio.create_task(forced.wait())
    await asyncio.wait({drain, force_wait}, return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        drain.cancel()
        await llm.shutdown(grace_s=0)
    force_wait.cancel()
    stop_wait.cancel()
    server.should_exit = True
    with contextlib.suppress(SystemExit):
        await serve_task
    return 0


@contextlib.contextmanager
def serve_in_thread(
    llm: AsyncLLM,
    app: FastAPI,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    grace_s: float = 0.0,
    log_level: str = "warning",
) -> Iterator[str]:
    """Serve `app` (over `llm`) from a background thread as `tune serve` does; yields the base URL.

    The same sequence as `serve_command` (`_serve`), stopped by leaving the block instead of by a
    signal: the block runs once /ready would answer 200; on exit new requests are refused,
    in-flight ones get grace_s to finish, the rest are aborted, and the thread is joined. The
    loaded model stays usable afterwards (`AsyncLLM(cfg, llm=llm)` then `llm` alone).

    Args:
        llm: the AsyncLLM to start (a given `llm=` skips the load, not the warm-up).
        app: `build_app(llm, ...)`.
        host, port: where to listen; port 0 takes a free port (the yielded URL names it).
        grace_s: drain time on exit.
    Raises:
        RuntimeError: the server did not start (the engine failed to start, or uvicorn could not
            listen), or its thread did not stop.
    """
    server = _uvicorn_server(app, host, port, grace_s, log_level)
    is_ready = threading.Event()
    box: dict = {}  # loop + stopping event (set by the thread), outcome

    async def main() -> int:
        box["loop"], box["stopping"] = asyncio.get_running_loop(), asyncio.Event()

        def on_ready() -> None:
            box["port"] = server.servers[0].sockets[0].getsockname()[1]
            is_ready.set()

        return await _serve(
            llm, server, stopping=box["stopping"], forced=asyncio.Event(), grace_s=grace_s, on_ready=on_ready
        )

    def run() -> None:
        try:
            box["code"] = event_loop.run(main())
        except BaseException as exc:  # uvicorn's SystemExit too; raised again in the caller's thread
            box["error"] = exc
        finally:
            is_ready.set()  # wakes the caller if we end before serving

    thread = threading.Thread(target=run, name="slotune-server", daemon=True)
    thread.start()
    is_ready.wait()
    if "port" not in box:
        thread.join()
        err = box.get("error")
        why = f"{type(err).__name__}: {err}" if err is not None else "uvicorn could not listen (it logged why)"
        raise RuntimeError(f"server did not start on {host}:{port}: {why}") from err
    try:
        yield f"http://{host}:{box['port']}"
    finally:
        with contextlib.suppress(RuntimeError):  # the loop already closed: the thread is ending anyway
            box["loop"].call_soon_threadsafe(box["stopping"].set)
        thread.join(grace_s + 30)
    if thread.is_alive():
        raise RuntimeError(f"server thread on {host}:{box['port']} did not stop within {grace_s + 30:g}s")
    if "error" in box:
        err = box["error"]
        raise RuntimeError(
            f"server on {host}:{box['port']} failed while stopping: {type(err).__name__}: {err}"
        ) from err


def serve_command(
    config: Path | None,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    grace_s: float = 20.0,
    record_traffic: Path | None = None,
    record_traffic_max_mib: float = 256,
    overrides: dict[str, Any] | None = None,
) -> None:
    """Load, warm up, serve; on SIGTERM stop accepting, drain for grace_s, exit 0. `overrides`
    (dotted EngineConfig fields) go over CONFIG's.

    A second SIGTERM/SIGINT skips the rest of the grace period (aborts what is left).
    With `record_traffic`, what is served is recorded there (slotune/engine/serving/traffic_recorder.py), the
    folder bounded by `record_traffic_max_mib`.
    """
    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    if overrides:
        cfg = cfg.with_updates(overrides)
    llm = AsyncLLM(cfg)
    recorder = None
    if record_traffic is not None:
        recorder = TrafficRecorder(
            record_traffic, max_total_mib=record_traffic_max_mib, max_file_mib=min(16.0, record_traffic_max_mib / 4)
        )
    app = build_app(llm, api_key=api_key, served_model_name=served_model_name, recorder=recorder)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> int:
        server = _uvicorn_server(app, host, port, grace_s, log_level="info")
        loop = asyncio.get_running_loop()
        stopping, forced = asyncio.Event(), asyncio.Event()

        def on_signal() -> None:
            if stopping.is_set():
                log.info("second signal: aborting in-flight requests now")
                forced.set()
                return
            log.info("shutdown signal: draining in-flight requests for up to %.0fs", grace_s)
            llm.is_accepting = False  # new requests get 503 while in-flight ones finish
            stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        log.info("loading %s", cfg.model)
        return await _serve(
            llm,
            server,
            stopping=stopping,
            forced=forced,
            grace_s=grace_s,
            on_ready=lambda: log.info("ready on http://%s:%d (model %s)", host, port, served_model_name or cfg.model),
        )

    try:
        code = event_loop.run(main())
    finally:
        if recorder is not None:
            recorder.close()  # the drained requests' lines reach the disk
    if code:
        raise SystemExit(code)
