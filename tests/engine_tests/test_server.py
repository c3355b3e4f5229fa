"""`tune serve` with the real engine and model: the official openai client, errors, metrics,
disconnects, and SIGTERM draining of a real server process on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from slotune.engine import EngineConfig
from slotune.engine.serving.async_llm import AsyncLLM
from slotune.tuner.measure.http_replay import wait_ready
from tests.faults import processes_left as faults_left

openai = pytest.importorskip("openai")
MODEL = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    """A real uvicorn server in a thread, on a loopback port."""
    import uvicorn

    from slotune.engine.serving.server import build_app

    cfg = EngineConfig(
        max_num_seqs=4,
        num_kv_blocks=64,
        max_model_len=512,
        admission={"max_prompt_tokens": 200, "max_queued_requests": 2},
    )
    llm = AsyncLLM(cfg)
    app = build_app(llm, api_key="sk-test")
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loop = asyncio.new_event_loop()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(llm.start())
        loop.run_until_complete(srv.serve())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, timeout_s=30)
    yield base, llm
    srv.should_exit = True
    t.join(10)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)


def _assert_engine_idle_soon(llm, timeout_s: float = 10.0) -> None:
    """The server notices a departed client asynchronously: within timeout_s nothing runs or waits
    and every KV block is free again."""
    for _ in range(int(timeout_s / 0.1)):
        st = llm.stats()
        if st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks:
            break
        time.sleep(0.1)
    st = llm.stats()
    assert st.num_running == 0 and st.num_free_blocks == st.num_total_blocks


def test_openai_client_completion_chat_and_stream(server):
    base, _ = server
    c = _client(base)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, seed=1)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length" and r.choices[0].text
    chat = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=30,
        temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    chunks = list(
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) >= 2  # streamed in pieces
    assert chunks[-1].usage.completion_tokens >= 1 and text
    stop = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"])
    assert " 7" not in stop.choices[0].text and stop.choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped_4xx(server):
    base, _ = server
    h = {"Authorization": "Bearer sk-test"}
    r = httpx.post(base + "/v1/completions", content=b"{not json", headers={**h, "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(base + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": -3}, headers=h)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "word " * 400}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401
    r = httpx.post(
        base + "/v1/completions", content=b"x" * (2 << 20), headers={**h, "content-type": "application/json"}
    )
    assert r.status_code == 413


def test_overload_returns_429_with_retry_after(server):
    base, _ = server
    h = {"Authorization": "Bearer sk-test"}

    async def burst():
        async with httpx.AsyncClient(base_url=base, headers=h, timeout=120) as c:
            body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 24, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(12)))

    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    assert all(r.headers.get("retry-after") for r in rs if r.status_code == 429)
    m = httpx.get(base + "/metrics").text
    assert 'slotune_requests_rejected_total{reason="queue_full"}' in m
    assert "slotune_time_to_first_token_seconds_bucket" in m


def test_client_disconnect_mid_stream_frees_blocks(server):
    base, llm = server
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        headers={"Authorization": "Bearer sk-test"},
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream
    _assert_engine_idle_soon(llm)


def test_sigterm_mid_stream_drains_refuses_new_and_exits_zero(tmp_path):
    port = _free_port()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_kv_blocks: 64\nmax_model_len: 512\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "slotune.tuner.cli_main", "serve", str(cfg), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, timeout_s=60, proc=proc)
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        first = next(it)  # mid-stream now
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        assert httpx.get(base + "/ready").status_code == 503
        rest = list(it)
        assert rest[-1].usage.completion_tokens == 40  # the in-flight stream finished within the grace period
        assert first.choices[0].text + "".join(ch.choices[0].text for ch in rest if ch.choices)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    out = proc.stdout.read()
    assert "Hello" not in out  # no prompt text in logs


def _stream(base: str, max_tokens: int, started: threading.Event | None = None) -> str:
    """One streamed completion: "complete" (every token and the usage), "refused" (503 shutting_down,
    or no connection once the server is gone) or what else happened (a lost request)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code == 503:
                return "refused" if json.loads(r.read())["error"]["code"] == "shutting_down" else "503 other"
            if r.status_code != 200:
                return f"status {r.status_code}"
            usage = None
            for line in r.iter_lines():
                if started is not None:
                    started.set()
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
            done = usage is not None and usage["completion_tokens"] == max_tokens
            return "complete" if done else f"cut at {usage}"
    except httpx.ConnectError:
        return "refused"
    except httpx.HTTPError as exc:
        return type(exc).__name__


@pytest.mark.fault("SIGTERM of `tune serve` under load")
def test_sigterm_under_load_completes_every_admitted_request(tmp_path, fault):
    """12 streams mid-flight and 4 more admitted when SIGTERM arrives, and new requests every 50 ms
    after it: every request admitted before the signal completes; later ones get a clean refusal (503
    shutting_down while draining, no connection once the process has exited, which it does with 0)."""
    from concurrent.futures import ThreadPoolExecutor

    port = _free_port()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_kv_blocks: 256\nmax_model_len: 512\nmax_num_seqs: 16\n")
    cmd = [sys.executable, "-m", "slotune.tuner.cli_main", "serve", str(cfg), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    pool = ThreadPoolExecutor(48)
    try:
        wait_ready(base, timeout_s=60, proc=proc)
        started = [threading.Event() for _ in range(12)]
        streaming = [pool.submit(_stream, base, 48, e) for e in started]
        assert all(e.wait(60) for e in started)
        just_sent = [pool.submit(_stream, base, 48) for _ in range(4)]
        deadline = time.monotonic() + 30
        while _in_engine(base) < 16:  # all admitted; the last ones may wait for a batch slot
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        late = []
        while proc.poll() is None and len(late) < 30:
            late.append(pool.submit(_stream, base, 8))
            time.sleep(0.05)
        before = [f.result(timeout=120) for f in streaming + just_sent]
        after = [f.result(timeout=120) for f in late]
        code = proc.wait(60)
        left = len(faults_left(fault.tag))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    lost = sum(o != "complete" for o in before) + sum(o != "refused" for o in after)
    fault.record(
        f"{sum(o == 'complete' for o in before)} of {len(before)} requests admitted before the signal completed; "
        f"{sum(o == 'refused' for o in after)} of {len(after)} after it were refused cleanly; exit {code}",
        processes_left=left,
        requests_lost=lost,
    ).assert_clean()
    assert code == 0, (before, after)


def _in_engine(base: str) -> float:
    """Requests the engine holds (running + waiting), from /metrics."""
    text = httpx.get(base + "/metrics", timeout=10).text
    names = ("slotune_num_requests_running ", "slotune_num_requests_waiting ")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(names))


def test_metrics_contract_names(server):
    """The operator judges canaries by these names: keep them stable."""
    base, _ = server
    m = httpx.get(base + "/metrics").text
    for name in (
        "slotune_time_to_first_token_seconds_bucket",
        "slotune_time_per_output_token_seconds_bucket",
        "slotune_e2e_request_latency_seconds_bucket",
        "slotune_prompt_tokens_total",
        "slotune_generation_tokens_total",
        "slotune_num_requests_running",
        "slotune_num_requests_waiting",
        "slotune_kv_blocks_used",
        "slotune_kv_blocks_free",
        "slotune_prefix_cache_hit_rate",
        "slotune_spec_decode_acceptance_rate",
        "slotune_http_responses_total",
    ):
        assert name in m, name


def test_hostile_sampling_params_never_kill_the_engine(server):
    """top_k beyond the vocab and out-of-int64 seeds used to raise inside the engine loop."""
    base, llm = server
    h = {"Authorization": "Bearer sk-test"}
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 1.0}
    assert httpx.post(base + "/v1/completions", json={**ok, "top_k": 10**9}, headers=h).status_code == 200
    assert httpx.post(base + "/v1/completions", json={**ok, "seed": -5}, headers=h).status_code == 200
    for bad, param in (
        ({"seed": 2**70}, "seed"),
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"n": 3}, "n"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
    ):
        r = httpx.post(base + "/v1/completions", json={**ok, **bad}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)
    r = httpx.post(
        base + "/v1/completions",
        content=b'{"model": "x", "prompt": "hi", "temperature": NaN}',
        headers={**h, "content-type": "application/json"},
    )
    assert r.status_code == 400
    assert llm.error is None and httpx.get(base + "/health").status_code == 200


def test_chat_content_parts_and_openai_shaped_http_errors(server):
    base, _ = server
    h = {"Authorization": "Bearer sk-test"}
    r = httpx.post(
        base + "/v1/chat/completions",
        headers=h,
        json={
            "model": MODEL,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.get(base + "/v1/nope", headers=h)
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = httpx.get(base + "/v1/completions", headers=h)
    assert r.status_code == 405 and "error" in r.json()


def test_chunked_body_over_the_limit_is_413(server):
    base, _ = server

    def body():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "smollm2-135m", "prompt": "'
        for _ in range(1100):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(
        base + "/v1/completions",
        content=body(),
        timeout=30,
        headers={"Authorization": "Bearer sk-test", "content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_non_stream_client_that_gives_up_is_aborted(server):
    base, llm = server
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            base + "/v1/completions",
            headers={"Authorization": "Bearer sk-test"},
            timeout=0.5,
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True},
        )
    _assert_engine_idle_soon(llm)  # 400 tokens would take far longer if the request kept running
    m = httpx.get(base + "/metrics").text
    assert 'slotune_requests_total{finish_reason="abort"}' in m


def _stream_events(base: str, **body) -> list[dict]:
    events = []
    with httpx.stream(
        "POST",
        base + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **body},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_stream_interval_sends_the_same_stream_in_fewer_events():
    """stream_interval: 4 sends a stream's tokens four at a time in one SSE event, the first token and
    the finish at once; the text, finish reason and usage are those of every-token streaming (1).
    One model load, served twice (real server, real model)."""
    from slotune.engine.serving.server import build_app, serve_in_thread

    streams, loaded = {}, None
    for n in (1, 4):
        llm = AsyncLLM(EngineConfig(max_num_seqs=2, num_kv_blocks=32, max_model_len=256, stream_interval=n), llm=loaded)
        with serve_in_thread(llm, build_app(llm)) as base:
            streams[n] = _stream_events(base, prompt="Once upon a time", max_tokens=21, ignore_eos=True)
        loaded = llm.llm
    text = {n: [e for e in ev if e["choices"]] for n, ev in streams.items()}
    assert "".join(e["choices"][0]["text"] for e in text[4]) == "".join(e["choices"][0]["text"] for e in text[1])
    assert text[4][0]["choices"][0]["text"] == text[1][0]["choices"][0]["text"]  # the first token alone: TTFT
    assert len(text[1]) >= 15 and len(text[4]) <= 1 + -(-(21 - 1) // 4) < len(text[1])
    assert text[4][-1]["choices"][0]["finish_reason"] == text[1][-1]["choices"][0]["finish_reason"] == "length"
    assert [e["usage"] for e in streams[4] if e.get("usage")] == [e["usage"] for e in streams[1] if e.get("usage")]


def test_stream_interval_is_bounded():
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


def test_the_served_event_loop_is_uvloop():
    """`tune serve` and the replay client run their coroutines through `event_loop.run`: on uvloop,
    with the coroutine's result returned (bench/peers/README.md: less CPU per streamed token)."""
    from slotune.engine.serving import event_loop

    async def which() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    assert event_loop.run(which()).startswith("uvloop")
