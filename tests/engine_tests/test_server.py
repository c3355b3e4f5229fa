"""`tune serve` with the real engine and model: the official openai client, errors, metrics,
disconnects, and SIGTERM draining of a real server process on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from slotune.engine import AsyncLLM, EngineConfig

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

    from slotune.engine.server import build_app

    cfg = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=512,
                       admission={"max_prompt_tokens": 200, "max_queued_requests": 2})
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
    for _ in range(300):
        try:
            if httpx.get(base + "/ready").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    yield base, llm
    srv.should_exit = True
    t.join(10)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0)


def test_openai_client_completion_chat_and_stream(server):
    base, _ = server
    c = _client(base)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, seed=1)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length" and r.choices[0].text
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                     max_tokens=30, temperature=0)
    assert "Paris" in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
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
    r = httpx.post(base + "/v1/completions", content=b"x" * (2 << 20), headers={**h, "content-type": "application/json"})
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
    with httpx.stream("POST", base + "/v1/completions", headers={"Authorization": "Bearer sk-test"},
                      json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                            "stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break  # leave mid-stream
    for _ in range(100):
        st = llm.stats()
        if st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks:
            break
        time.sleep(0.1)
    st = llm.stats()
    assert st.num_running == 0 and st.num_free_blocks == st.num_total_blocks


def test_sigterm_drains_in_flight_and_exits_zero(tmp_path):
    port = _free_port()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_kv_blocks: 64\nmax_model_len: 512\n")
    proc = subprocess.Popen([sys.executable, "-m", "slotune.tuner.cli_main", "serve", str(cfg), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        result = {}

        def long_request():
            result["r"] = httpx.post(base + "/v1/completions", timeout=60,
                                     json={"model": MODEL, "prompt": "Hello", "max_tokens": 40, "ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0
        assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 40
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    out = proc.stdout.read()
    assert "Hello" not in out  # no prompt text in logs
