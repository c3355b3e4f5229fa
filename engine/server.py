"""`tune serve`: OpenAI-compatible HTTP API over AsyncLLM (FastAPI + uvicorn).

The engine loop runs in its own thread; handlers only enqueue and await deltas. Admission
failures map to 400 (never fits) or 429 + Retry-After (overload). A client that disconnects
mid-stream has its sequence aborted, freeing its KV blocks at once. Prompt text never
reaches the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from slotune.engine.async_llm import AsyncLLM
from slotune.engine.config import EngineConfig
from slotune.engine.llm_engine import RequestRejected
from slotune.engine.sampling_params import SamplingParams

log = logging.getLogger("slotune.server")
OVERLOAD_REASONS = {"queue_full", "tokens_in_flight"}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# --- protocol -----------------------------------------------------------------------------
class _Req(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore (user, logit_bias=None...)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False


class CompletionRequest(_Req):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Req):
    messages: list[ChatMessage] = Field(min_length=1)


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


# --- metrics ------------------------------------------------------------------------------
class ServingMetrics:
    """Prometheus metrics on a per-app registry (names are what the operator scrapes)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("slotune_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("slotune_time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("slotune_e2e_request_latency_seconds", "End-to-end request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("slotune_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("slotune_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("slotune_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("slotune_requests_rejected", "Rejected requests", ["reason"], registry=r)
        self.running = Gauge("slotune_num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("slotune_num_requests_waiting", "Requests waiting", registry=r)
        self.kv_used = Gauge("slotune_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_free = Gauge("slotune_kv_blocks_free", "KV blocks free", registry=r)
        self.prefix_hit = Gauge("slotune_prefix_cache_hit_rate", "Prefix cache hit rate (tokens)", registry=r)
        self.spec_accept = Gauge("slotune_spec_decode_acceptance_rate", "Speculative draft acceptance rate", registry=r)

    def observe_finished(self, out) -> None:
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.output_token_ids))
        self.requests.labels(out.finish_reason or "unknown").inc()

    def refresh(self, stats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.num_total_blocks - stats.num_free_blocks)
        self.kv_free.set(stats.num_free_blocks)
        self.prefix_hit.set(stats.prefix_cache_hit_rate)
        self.spec_accept.set(stats.spec_acceptance_rate)


# --- app ----------------------------------------------------------------------------------
def build_app(llm: AsyncLLM, *, api_key: str | None = None, served_model_name: str | None = None,
              max_body_bytes: int = 1 << 20, retry_after_s: int = 1) -> FastAPI:
    app = FastAPI(title="slotune", docs_url=None, redoc_url=None)
    model_id = served_model_name or llm.config.model
    metrics = ServingMetrics()
    app.state.metrics = metrics
    app.state.llm = llm

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/v1/"):
            size = request.headers.get("content-length")
            if size is not None and int(size) > max_body_bytes:
                return _error(413, f"request body exceeds {max_body_bytes} bytes")
            if api_key is not None:
                auth = request.headers.get("authorization", "")
                token = auth[7:] if auth.lower().startswith("bearer ") else ""
                if not hmac.compare_digest(token.encode(), api_key.encode()):
                    return _error(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
            if not llm.is_accepting:
                return _error(503, "server is shutting down", "unavailable", headers={"Retry-After": "5"})
            if not llm.is_ready:
                return _error(503, "model is not ready", "unavailable", headers={"Retry-After": "5"})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON")
        return _error(400, "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body')}: {e['msg']}" for e in errs), param=param)

    @app.get("/health")
    async def health():
        if llm.error is not None:
            return _error(500, f"engine loop died: {llm.error!r}", "internal_error")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not llm.is_ready or not llm.is_accepting:
            return _error(503, "not ready", "unavailable")
        return {"status": "ready"}

    @app.get("/metrics")
    async def prom():
        if llm.is_ready:
            metrics.refresh(llm.stats())
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "slotune"}]}

    def _params(req: _Req) -> SamplingParams | JSONResponse:
        if req.model != model_id:
            return _error(404, f"model '{req.model}' does not exist; this server serves '{model_id}'", param="model",
                          code="model_not_found")
        if req.n != 1:
            return _error(400, "n > 1 is not supported; send separate requests", param="n")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(max_tokens=req.max_completion_tokens or req.max_tokens or 16, temperature=req.temperature,
                              top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=stop, ignore_eos=req.ignore_eos)

    async def _run(prompt, params: SamplingParams, req: _Req, request: Request, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        try:
            await llm.add_request(prompt, params, rid)
        except RequestRejected as exc:
            metrics.rejected.labels(exc.reason).inc()
            if exc.reason in OVERLOAD_REASONS:
                return _error(429, f"server overloaded: {exc.message}", "rate_limit_error", code=exc.reason,
                              headers={"Retry-After": str(retry_after_s)})
            return _error(400, exc.message, param="max_tokens" if "max_tokens" in exc.reason else "prompt", code=exc.reason)
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if req.stream:
            include_usage = bool((req.stream_options or {}).get("include_usage"))
            return StreamingResponse(_sse(rid, created, obj, chat, include_usage, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        last = None
        stream = llm.stream(rid)
        try:
            async for out in stream:
                last = out
                if await request.is_disconnected():
                    break
        finally:
            await stream.aclose()
        if last is None or not last.finished:
            return _error(499, "client closed request", "aborted")
        metrics.observe_finished(last)
        usage = _usage(last)
        choice = ({"index": 0, "message": {"role": "assistant", "content": last.text}, "finish_reason": last.finish_reason}
                  if chat else {"index": 0, "text": last.text, "finish_reason": last.finish_reason, "logprobs": None})
        return {"id": rid, "object": obj, "created": created, "model": model_id, "choices": [choice], "usage": usage}

    def _usage(out) -> dict[str, int]:
        p, c = len(out.prompt_token_ids), len(out.output_token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def _sse(rid, created, obj, chat, include_usage, request: Request):
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_text: str | None, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created, "model": model_id,
                                          "choices": [choice]}) + "\n\n"

        stream = llm.stream(rid)
        try:
            if chat:
                yield chunk(None, None, first=True)
            last = None
            async for out in stream:
                last = out
                if out.new_text or out.finished:
                    yield chunk(out.new_text, out.finish_reason if out.finished else None)
            if last is not None:
                metrics.observe_finished(last)
                if include_usage:
                    yield "data: " + json.dumps({"id": rid, "object": chunk_obj, "created": created, "model": model_id,
                                                 "choices": [], "usage": _usage(last)}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()  # disconnect (GeneratorExit/cancel): abort + free blocks now

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        params = _params(req)
        if isinstance(params, JSONResponse):
            return params
        if isinstance(req.prompt, str) and not req.prompt:
            return _error(400, "prompt must not be empty", param="prompt")
        return await _run(req.prompt, params, req, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        params = _params(req)
        if isinstance(params, JSONResponse):
            return params
        prompt = llm.tokenizer.apply_chat_template([m.model_dump() for m in req.messages], add_generation_prompt=True)
        return await _run(prompt, params, req, request, chat=True)

    return app


def serve_command(config: Path | None, host: str, port: int, api_key: str | None, served_model_name: str | None,
                  grace_s: float = 20.0) -> None:
    """Load, warm up, serve; on SIGTERM stop accepting, drain for grace_s, exit 0."""
    import uvicorn

    cfg = EngineConfig.from_yaml(config) if config else EngineConfig()
    llm = AsyncLLM(cfg)
    app = build_app(llm, api_key=api_key, served_model_name=served_model_name)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # we own SIGTERM: drain first, then stop uvicorn
            yield

    async def main() -> None:
        server = _Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                                        timeout_graceful_shutdown=int(grace_s) + 5))
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()

        def on_term() -> None:
            if not stopping.is_set():
                log.info("shutdown signal: draining in-flight requests for up to %.0fs", grace_s)
                llm.is_accepting = False  # new requests get 503 while in-flight ones finish
                stopping.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_term)
        serve_task = asyncio.create_task(server.serve())
        log.info("loading %s", cfg.model)
        await llm.start()
        log.info("ready on http://%s:%d (model %s)", host, port, served_model_name or cfg.model)
        await stopping.wait()
        await llm.shutdown(grace_s=grace_s)
        server.should_exit = True
        await serve_task

    asyncio.run(main())
