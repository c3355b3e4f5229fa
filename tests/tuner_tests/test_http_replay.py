"""`run_http_replay` and `tune bench --url` against a real `tune serve` subprocess on loopback.

Real: the server process (`python -m slotune.tuner.cli_main serve`: the bundled SmolLM2 on
CPU, our engine, uvicorn, an API key, an admission limit on tokens in flight), the tokenizer,
the HTTP client and its SSE streams, the CLI. The connection-failure test aims at a loopback
port nobody listens on. Server-side counters (/metrics) check what the client claims: the
warm-up really ran, 429s were not retried, cancelled streams were aborted. One test replays
scripted SSE streams from a stdlib HTTP server (said there): shapes our server never sends
(several tokens per chunk, an error object mid-stream, a cut-off stream). Workloads are tiny
(a few requests of 4-8 tokens), one `tune serve` serves the module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from slotune.tuner.cli import app
from slotune.tuner.measure.http_replay import run_http_replay, wait_ready
from slotune.tuner.measure.http_stream import split_itls
from slotune.tuner.measure.in_process_replay import load_tokenizer
from slotune.tuner.measure.metrics import ReplayResult
from slotune.tuner.report.terminal import print_result
from slotune.tuner.spec.workload_spec import WorkloadSpec
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
KEY = "sk-bench"
# 600 tokens in flight: two concurrent 16+8 (or chat 46+8) requests fit, two 300+8 ones do not.
SERVER_CONFIG = """\
max_num_seqs: 4
num_kv_blocks: 64
max_model_len: 512
admission:
  max_tokens_in_flight: 600
"""
BASE = {
    "name": "http-tiny",
    "num_requests": 6,
    "warmup_requests": 1,
    "concurrency": 2,
    "prompt_len": {"kind": "fixed", "value": 16},
    "output_len": {"kind": "fixed", "value": 8},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`tune serve` in its own process, with an API key; SIGTERM (then SIGKILL) on teardown."""
    d = tmp_path_factory.mktemp("serve")
    (d / "serve.yaml").write_text(SERVER_CONFIG)
    port = _free_port()
    log = open(d / "serve.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "slotune.tuner.cli_main",
            "serve",
            str(d / "serve.yaml"),
            "--port",
            str(port),
            "--api-key",
            KEY,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(base, proc=proc)
        except RuntimeError as exc:
            pytest.fail(f"tune serve: {exc}: {(d / 'serve.log').read_text()[-2000:]}")
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def _scrape(base: str) -> dict[str, float]:
    """The server's Prometheus samples: {'name{labels}': value}."""
    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_completions_token_counts_match_the_workload(server, tokenizer):
    seen = []
    before = _scrape(server)
    res = run_http_replay(
        server,
        WorkloadSpec(**BASE),
        tokenizer=tokenizer,
        api_key=KEY,
        percentiles=(80,),
        on_progress=lambda done, total: seen.append((done, total)),
    )
    after = _scrape(server)
    m = res.metrics
    assert res.device == "http" and not res.early_stopped and seen[-1] == (6, 6)
    assert res.config == {"url": server, "api": "completions", "model": MODEL, "served_models": [MODEL]}
    assert sorted(r.request_id for r in res.records) == [f"req-{i}" for i in range(6)]  # warm-up excluded
    for r in res.records:
        assert (r.finish_reason, r.output_tokens, r.prompt_tokens) == ("length", 8, 16)  # ignore_eos, token-id prompt
        assert 0 < r.ttft < r.e2e and r.tpot > 0 and len(r.itls) == 7 and r.queue_time is None
        assert r.tpot == pytest.approx(sum(r.itls) / 7)
    assert m["num_completed"] == 6 and m["output_tokens"] == 48 and m["prompt_tokens"] == 96
    assert m["num_failed"] == 0 and m["num_errors"] == 0 and m["num_short_outputs"] == 0 and m["client_cpu_s"] > 0
    assert "ttft_p80" in m and m["ttft_p50"] <= m["e2e_p50"] and "queue_time_p50" not in m
    # The server generated what we counted, plus the one warm-up request: it ran, and is not in the records.
    assert _delta(before, after, "slotune_generation_tokens_total") == 7 * 8
    again = ReplayResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again.records == res.records and again.metrics == m and again.device == "http"


def test_chat_api_gets_the_same_lengths(server, tokenizer):
    res = run_http_replay(
        server + "/v1/",
        WorkloadSpec(**{**BASE, "warmup_requests": 0}),
        tokenizer=tokenizer,
        api_key=KEY,
        model=MODEL,
        api="chat",
    )
    assert res.config["api"] == "chat" and res.config["url"] == server
    assert res.metrics["num_completed"] == 6 and res.metrics["output_tokens"] == 48
    for r in res.records:
        assert r.output_tokens == 8 and r.prompt_tokens > 16  # the server's chat template, from usage
        assert 0 < r.ttft < r.e2e and r.tpot > 0 and len(r.itls) == 7
    with pytest.raises(ValueError, match="mode 'chat'"):  # templated twice otherwise
        run_http_replay(server, WorkloadSpec(**{**BASE, "mode": "chat"}), tokenizer=tokenizer, api="chat")
    with pytest.raises(ValueError, match="api: must be one of"):
        run_http_replay(server, WorkloadSpec(**BASE), tokenizer=tokenizer, api="responses")


def test_wrong_api_key_counts_every_request_as_401(server, tokenizer, capsys):
    res = run_http_replay(server, WorkloadSpec(**BASE), tokenizer=tokenizer, api_key="sk-wrong", model=MODEL)
    m = res.metrics
    assert len(res.records) == 6 and all(r.finish_reason == "rejected" for r in res.records)
    assert m["num_failed_401"] == 6 and m["num_failed"] == 6 and m["num_rejected"] == 6 and m["num_completed"] == 0
    assert "ttft_p50" not in m and m["goodput_rps"] == 0
    print_result(res)
    assert "failed: 401" in capsys.readouterr().out
    with pytest.raises(ValueError, match="401"):  # no model id to request: the lookup must succeed
        run_http_replay(server, WorkloadSpec(**BASE), tokenizer=tokenizer, api_key="sk-wrong")


def test_overload_429s_are_counted_once_not_retried(server, tokenizer):
    wl = WorkloadSpec(
        **{
            **BASE,
            "num_requests": 8,
            "warmup_requests": 0,
            "concurrency": 3,
            "prompt_len": {"kind": "fixed", "value": 300},
        }
    )
    before = _scrape(server)
    res = run_http_replay(server, wl, tokenizer=tokenizer, api_key=KEY)
    after = _scrape(server)
    m = res.metrics
    assert len(res.records) == 8 and m["num_failed_429"] > 0 and m["num_completed"] >= 1
    assert m["num_completed"] + m["num_failed_429"] == 8 and m["num_rejected"] == m["num_failed_429"]
    # One 429 per record on the server too: no request was retried.
    assert _delta(before, after, 'slotune_requests_rejected_total{reason="tokens_in_flight"}') == m["num_failed_429"]


def test_open_loop_arrival_is_the_scheduled_time(server, tokenizer):
    wl = WorkloadSpec(**{**BASE, "arrivals": "fixed_rate", "rate": 20.0, "num_requests": 3, "warmup_requests": 0})
    res = run_http_replay(server, wl, tokenizer=tokenizer, api_key=KEY, model=MODEL)
    assert [round(r.arrival_s, 3) for r in sorted(res.records, key=lambda r: r.arrival_s)] == [0.0, 0.05, 0.1]
    assert res.metrics["num_completed"] == 3 and all(0 < r.ttft < r.e2e for r in res.records)


def test_unreachable_server_counts_connection_failures(tokenizer):
    url = f"http://127.0.0.1:{_free_port()}"  # nobody listens there
    res = run_http_replay(url, WorkloadSpec(**{**BASE, "num_requests": 3}), tokenizer=tokenizer, model=MODEL)
    assert len(res.records) == 3 and all(r.finish_reason == "error" for r in res.records)
    assert res.metrics["num_failed_connection"] == 3 and res.metrics["num_errors"] == 3
    assert res.config["served_models"] == []
    with pytest.raises(ValueError, match="cannot reach"):
        run_http_replay(url, WorkloadSpec(**BASE), tokenizer=tokenizer)


def test_should_stop_cancels_streams_and_the_server_aborts_them(server, tokenizer, tmp_path):
    trace = tmp_path / "trace.jsonl"  # one short request, two long ones in flight beside it
    trace.write_text("".join(json.dumps({"prompt_len": 16, "output_len": n}) + "\n" for n in (4, 200, 200)))
    wl = WorkloadSpec(**{**BASE, "num_requests": 3, "warmup_requests": 0, "concurrency": 3, "trace": str(trace)})
    before = _scrape(server)
    res = run_http_replay(
        server, wl, tokenizer=tokenizer, api_key=KEY, model=MODEL, should_stop=lambda records: len(records) >= 1
    )
    assert res.early_stopped and len(res.records) == 1 and res.records[0].output_tokens == 4
    for _ in range(200):  # the server notices the closed streams asynchronously
        after = _scrape(server)
        if (
            _delta(before, after, 'slotune_requests_total{finish_reason="abort"}') >= 2
            and after["slotune_num_requests_running"] == 0
            and after["slotune_kv_blocks_used"] == 0
        ):
            break
        time.sleep(0.1)
    assert _delta(before, after, 'slotune_requests_total{finish_reason="abort"}') == 2
    assert _delta(before, after, "slotune_generation_tokens_total") < 2 * 200  # not run to the end
    assert after["slotune_num_requests_running"] == 0 and after["slotune_kv_blocks_used"] == 0


def _chunk(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


# Scripted streams, by requested model id: llama-server-like multi-token chunks with a trailing
# text-less finish chunk, an error object mid-stream, and a stream cut off without [DONE].
_SCRIPTS = {
    "multi": [
        _chunk("a"),
        _chunk("bc"),
        _chunk("def"),
        _chunk("", "length"),
        {"choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": 6}},
        "[DONE]",
    ],
    "error": [_chunk("a"), {"error": {"message": "engine died", "type": "server_error"}}],
    "truncated": [_chunk("a"), _chunk("b")],
}


class _ScriptedSSE(BaseHTTPRequestHandler):
    def do_GET(self):  # /v1/models
        body = json.dumps({"data": [{"id": "multi"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        script = _SCRIPTS[json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for event in script:
            time.sleep(0.01)
            self.wfile.write(f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode())
            self.wfile.flush()

    def log_message(self, *args):
        pass


def test_multi_token_chunks_stream_errors_and_cut_streams(tokenizer):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ScriptedSSE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    wl = WorkloadSpec(**{**BASE, "num_requests": 2, "warmup_requests": 0, "output_len": {"kind": "fixed", "value": 6}})
    try:
        multi = run_http_replay(url, wl, tokenizer=tokenizer)
        error = run_http_replay(url, wl, tokenizer=tokenizer, model="error")
        cut = run_http_replay(url, wl, tokenizer=tokenizer, model="truncated")
    finally:
        srv.shutdown()
        srv.server_close()
    assert multi.metrics["num_completed"] == 2 and multi.metrics["num_short_outputs"] == 0
    for r in multi.records:  # 6 tokens in 3 text chunks: 5 ITLs summing to last - first
        assert (r.output_tokens, r.finish_reason, len(r.itls)) == (6, "length", 5)
        assert r.tpot == pytest.approx(sum(r.itls) / 5) and r.itls[0] == r.itls[1]
    assert error.metrics["num_failed_stream_error"] == 2 and error.metrics["num_errors"] == 2
    assert cut.metrics["num_failed_incomplete"] == 2 and all(r.finish_reason == "error" for r in cut.records)


def test_cli_bench_url_writes_json(server, tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        app,
        [
            "bench",
            "--url",
            server,
            "--workload",
            str(ROOT / "examples/workloads/tiny.yaml"),
            "--json",
            str(out),
            "--tokenizer",
            MODEL,
        ],
        env={"SLOTUNE_API_KEY": KEY},
    )
    assert r.exit_code == 0, r.output
    assert "ttft" in r.output and "output tokens/s" in r.output and "peak KV blocks" not in r.output
    d = json.loads(out.read_text())
    assert d["device"] == "http" and d["config"]["url"] == server and d["config"]["model"] == MODEL
    assert d["metrics"]["num_completed"] == 4 and d["metrics"]["output_tokens"] == 32 and len(d["records"]) == 4


def test_cli_url_flag_mistakes_are_clean_errors(server):
    r = CliRunner().invoke(app, ["bench", "--model", MODEL])
    assert r.exit_code == 2 and "only applies with --url" in r.output
    r = CliRunner().invoke(app, ["bench", "--url", server, "--set", "max_num_seqs=2"])
    assert r.exit_code == 2 and "--set" in r.output
    r = CliRunner().invoke(app, ["bench", "--url", server, "--api", "responses"])
    assert r.exit_code == 2


def test_bench_help_imports_neither_torch_nor_httpx():
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom slotune.tuner.cli import app\n"
        "r = CliRunner().invoke(app, ['bench', '--help'])\nassert '--url' in r.output, r.output\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'mlflow', 'httpx'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_split_itls_spreads_multi_token_chunks_evenly():
    assert split_itls([0.0, 1.0, 3.0], 3) == [1.0, 2.0]  # one token per chunk: the gaps as they are
    assert split_itls([0.0, 1.0, 3.0], 5) == [0.5, 0.5, 1.0, 1.0]  # two tokens in each later chunk
    assert split_itls([0.0, 1.0, 3.0], 4) == [0.5, 0.5, 2.0]  # the remainder goes to the first gaps
    spread = split_itls([0.0, 0.3, 0.4, 1.0], 11)
    assert len(spread) == 10 and sum(spread) == pytest.approx(1.0)
    assert split_itls([0.0], 6) == []


class _KeepAliveThenClose(_ScriptedSSE):
    """llama-server's habit (the llama.cpp that llama-cpp-python 0.3.36 vendors): each streamed
    response says `Keep-Alive`, is sent chunked over HTTP/1.1, and then the server closes the
    connection. A stand-in, though CI builds llama-server: whether the real one's close reaches the
    client before its next request is a race; here every next request meets a closed connection."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Keep-Alive", "timeout=5, max=100")
        self.end_headers()
        for event in _SCRIPTS["multi"]:
            data = f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def handle(self):
        self.handle_one_request()  # answered, the connection left open
        # Closed only once the client sends its next request on it (without `Connection: close`), so
        # that request always meets a closed connection, however fast the client notices the first close.
        self.rfile.readline()


def test_a_pooled_connection_the_server_closed_is_resent_not_failed(tokenizer):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveThenClose)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    wl = WorkloadSpec(
        **{
            **BASE,
            "num_requests": 6,
            "warmup_requests": 1,
            "concurrency": 1,
            "output_len": {"kind": "fixed", "value": 6},
        }
    )
    try:
        res = run_http_replay(url, wl, tokenizer=tokenizer)
    finally:
        srv.shutdown()
        srv.server_close()
    assert res.metrics["num_failed"] == 0 and res.metrics["num_completed"] == 6
    assert res.metrics["num_resent"] >= 1  # every request after the first met a closed connection
