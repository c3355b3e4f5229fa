"""`tune serve BEST.yaml` of a llama-server study: the real llama-server behind the metering proxy
(skipped where llama-server is not on PATH). What the operator judges a canary on comes out of its
/metrics; the proxy stops with the server, and the server with the proxy."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from slotune.engine.serving.serving_metrics import ServingMetrics
from slotune.operator import metrics as canary_metrics
from slotune.tuner.metered_proxy import StreamTimer
from slotune.tuner.spec.server import ServerConfig

from tests.faults import wait_until

LLAMA_SERVER = shutil.which("llama-server")
TUNE = str(Path(sys.executable).parent / "tune")


def test_a_streamed_answer_is_timed_from_its_text_chunks():
    metrics = ServingMetrics()
    timer = StreamTimer(start=10.0)
    chunk = lambda text: f"data: {json.dumps({'choices': [{'delta': {'content': text}}]})}\n\n".encode()  # noqa: E731
    timer.feed(b"data: " + json.dumps({"choices": [{"delta": {"role": "assistant"}}]}).encode() + b"\n\n", 10.1)
    whole = chunk("a") + chunk("b") + chunk("c")
    timer.feed(whole[:20], 10.5)  # a chunk split across reads is parsed once it is whole
    timer.feed(whole[20:], 10.5)
    timer.feed(chunk("d"), 11.1)
    timer.feed(b'data: {"choices": [], "usage": {"completion_tokens": 5}}\n\ndata: [DONE]\n\n', 11.2)
    timer.observe(metrics, end=11.3)
    h = canary_metrics.parse(_exposition(metrics))
    assert h["ttft"].count == 1 and h["ttft"].total == pytest.approx(0.5)
    assert h["tpot"].total == pytest.approx(0.6 / 4)  # first to last text chunk over the 5 tokens usage gives
    assert h["e2e"].total == pytest.approx(1.3)


def _exposition(metrics: ServingMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _stream(url: str, key: str) -> str:
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def _start(best: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [TUNE, "serve", str(best), "--port", str(port), "--api-key", "k"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _server_under(proc: subprocess.Popen, url: str) -> psutil.Process:
    wait_until(lambda: _get(url + "/ready")[0] == 200, 180, "the proxy ready")
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "llama-server"][0]


@pytest.mark.skipif(LLAMA_SERVER is None, reason="needs llama.cpp's llama-server on PATH")
def test_tune_serve_of_a_servers_best_yaml_serves_it_metered(tmp_path):
    best = tmp_path / "best.yaml"
    best.write_text(
        ServerConfig(engine="llama-server", model="smollm2-135m", knobs={"threads": 2, "parallel": 2}).to_yaml()
    )
    refused = subprocess.run([TUNE, "serve", str(best), "--served-model-name", "m"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--served-model-name: options of the bundled engine's server" in refused.stderr
    port = _port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(best, port)
    try:
        server = _server_under(proc, url)
        assert '"total_slots":2' in _get(url + "/props")[1].replace(" ", "")  # forwarded to the server
        assert _get(url + "/v1/models")[0] == 401  # the key guards the API
        for _ in range(3):
            assert "[DONE]" in _stream(url, "k")
        status, text = _get(url + "/metrics")
        h = canary_metrics.parse(text)
        assert status == 200 and h["ttft"].count == 3 and h["tpot"].count == 3
        assert 0 < h["ttft"].quantile(0.95) < 30 and 0 < h["tpot"].quantile(0.95) < 5
        assert "llamacpp:tokens_predicted_total" in text  # the server's own metrics follow
        server.kill()  # the server dies: the proxy exits 1, so a pod restarts
        assert proc.wait(timeout=30) == 1
        assert "llama-server ended: crashed under load: killed by signal 9" in proc.stderr.read()
        proc = _start(best, port)
        server = _server_under(proc, url)
        proc.send_signal(signal.SIGTERM)  # stopped: exit 0, and the server with it
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: not server.is_running() or server.status() == psutil.STATUS_ZOMBIE, 15, "no server")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
