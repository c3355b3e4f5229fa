"""Fuzz `tune serve` with hostile bodies over real loopback connections (uvicorn, httpx, raw sockets).

Bodies are mutations of a valid completion or chat request: a field set to the wrong type, a
huge or negative number, nested garbage or a giant string; a field deleted; an unknown or
unhonoured field added; messages empty, of unknown roles or in an order the template refuses;
then, at the byte level, NaN/Infinity literals, lone surrogate escapes, invalid UTF-8, a BOM,
UTF-16, truncation, deep nesting or duplicate keys. Each is sent streaming or not, and read to
the end, or the client leaves: right after sending (FIN or RST), halfway through the body, or
after the first streamed line. Asserted: no 5xx (seen by the client, counted in /metrics, or
logged by the server), the engine loop alive afterwards, every KV block free.

Bounded for CI (FUZZ_EXAMPLES, default 150, the same bodies every run); FUZZ_EXAMPLES=1000
searches longer with fresh random bodies and prints the statuses by code (pytest -s).
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import os
import re
import socket
import struct
import time

import httpx
import pytest

from slotune.engine import EngineConfig
from slotune.engine.serving.async_llm import AsyncLLM
from slotune.engine.serving.api_protocol import IGNORED, REJECTED_UNLESS_DEFAULT
from slotune.engine.serving.server import build_app, serve_in_thread

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MODEL = "smollm2-135m"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=list(HealthCheck),
)
MAX_BODY_BYTES = 1 << 20
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "best_of",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "ignore_eos",
    *sorted(REJECTED_UNLESS_DEFAULT),
    *sorted(IGNORED),
    "max_token",
    "guided_json",
]

INTS = st.one_of(
    st.sampled_from([0, -1, 1, 2, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.integers(-(2**70), -1),
    st.integers(2**40, 2**70),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=24),
    st.sampled_from(["", " ", "\x00", "\u2028", "\U0001f642", "a" * 300]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
PROMPTS = st.one_of(
    st.sampled_from(
        [
            "",
            " ",
            "\x00" * 8,
            "x" * 600_000,
            "word " * 5000,
            [],
            [-1],
            [10**9],
            [[1, 2]],
            ["a", "b"],
            [""],
            [1] * 600,
            list(range(100, 400)),
            [2**63],
            [True, False],
        ]
    ),
    st.text(min_size=1, max_size=64),
    st.lists(st.integers(0, 49151), min_size=1, max_size=64),
)
MESSAGE_LISTS = st.sampled_from(
    [
        [],
        [{}],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "wizard", "content": "hi"}],
        [{"role": "function", "content": "hi", "name": "f"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": []}],
        [{"role": "assistant", "content": "first"}],
        [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}],
        [{"role": "tool", "content": "42", "tool_call_id": "x"}],
        [{"role": "user", "content": "hi", "name": {"a": [1]}}],
        [{"role": "user", "content": "hi"}] * 1025,
        [{"role": "user", "content": "y" * 500_000}],
        [{"role": "user", "content": "{{ 7*7 }} {% for x in range(10**9) %}{% endfor %}"}],
        [
            {
                "role": "user",
                "content": "hi",
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            }
        ],
    ]
)
DELIVERIES = ["read"] * 6 + ["leave_after_send", "reset_after_send", "partial_body"] + ["leave_mid_stream"] * 3


@st.composite
def bodies(draw) -> tuple[str, bytes, str]:
    """(path, raw body, delivery)."""
    chat = draw(st.booleans())
    body = {**copy.deepcopy(CHAT if chat else COMPLETION), "stream": draw(st.booleans())}
    for _ in range(draw(st.sampled_from([0, 0, 1, 2, 3]))):  # 0: valid, unless mangled below
        kind = draw(st.sampled_from(["set", "set", "delete", "prompt", "messages", "stream"]))
        if kind == "set":
            body[draw(st.sampled_from(FIELDS))] = draw(VALUES)
        elif kind == "delete" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif kind == "prompt":
            body["prompt"] = draw(PROMPTS)
        elif kind == "messages":
            body["messages"] = draw(MESSAGE_LISTS)
        else:
            body["stream"] = draw(st.booleans())
            if draw(st.booleans()):
                body["stream_options"] = {"include_usage": draw(st.booleans())}
    raw = json.dumps(body).encode()  # ASCII: anything else is escaped
    raw = _mangle(raw, draw(st.sampled_from(["none"] * 4 + list(MANGLERS))), draw(st.integers(0, 1 << 20)))
    if len(raw) > MAX_BODY_BYTES:  # the 413 path is tested elsewhere; keep the bodies in bounds
        raw = raw[:MAX_BODY_BYTES]
    wrong_path = draw(st.integers(0, 9)) == 0
    path = "/v1/chat/completions" if chat != wrong_path else "/v1/completions"
    return path, raw, draw(st.sampled_from(DELIVERIES))


def _replace_value(raw: bytes, literal: bytes) -> bytes:
    return re.sub(
        rb'("max_tokens": |"temperature": |"prompt": |"content": )("[^"]*"|[-0-9.e]+)',
        lambda m: m.group(1) + literal,
        raw,
        count=1,
    )  # a function: the literal's backslashes stay


MANGLERS = {
    "nan": lambda raw, k: _replace_value(raw, [b"NaN", b"Infinity", b"-Infinity"][k % 3]),
    "surrogate": lambda raw, k: _replace_value(raw, [b'"\\ud800"', b'"a\\udfffb"', b'"\\ud83d"'][k % 3]),
    "surrogate_key": lambda raw, k: raw.replace(b"{", b'{"\\udc80": 1, ', 1),
    "bad_utf8": lambda raw, k: _replace_value(
        raw, [b'"\xff\xfe"', b'"\xc3"', b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"'][k % 4]
    ),
    "truncate": lambda raw, k: raw[: k % max(1, len(raw))],
    "deep": lambda raw, k: raw.replace(b"{", b'{"user": ' + b"[" * (20 + k % 5000) + b"]" * (20 + k % 5000) + b", ", 1),
    "deep_dict": lambda raw, k: raw.replace(
        b"{", b'{"metadata": ' + b'{"a": ' * (30 + k % 100) + b"1" + b"}" * (30 + k % 100) + b", ", 1
    ),
    "garbage": lambda raw, k: struct.pack("<Q", k) * (1 + k % 7),
    "bom": lambda raw, k: b"\xef\xbb\xbf" + raw,
    "utf16": lambda raw, k: raw.decode().encode("utf-16"),
    "duplicate_key": lambda raw, k: raw[:-1] + b', "max_tokens": 3, "max_tokens": -1}' if raw.endswith(b"}") else raw,
    "not_object": lambda raw, k: [b"[]", b"null", b"42", b'"prompt"', b"true", b"{}", b""][k % 7],
}


def _mangle(raw: bytes, how: str, k: int) -> bytes:
    return raw if how == "none" else MANGLERS[how](raw, k)


class _Errors(logging.Handler):
    """Records from the server and uvicorn at ERROR and above: an unhandled exception shows here
    even when its client had already left."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


@pytest.fixture(scope="module")
def server():
    errors = _Errors()
    loggers = [logging.getLogger(n) for n in ("slotune.server", "uvicorn.error", "uvicorn")]
    for lg in loggers:
        lg.addHandler(errors)
    cfg = EngineConfig(max_num_seqs=4, num_kv_blocks=64, max_model_len=512)  # default admission bounds
    llm = AsyncLLM(cfg)
    try:
        with serve_in_thread(llm, build_app(llm)) as base:
            yield base, llm, errors
    finally:
        for lg in loggers:
            lg.removeHandler(errors)


def _leave(base: str, path: str, raw: bytes, how: str) -> None:
    """Send raw HTTP/1.1 and go away without reading the answer."""
    host, port = base.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + (raw[: len(raw) // 2] if how == "partial_body" else raw))
        if how == "reset_after_send":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN


def _send(client: httpx.Client, base: str, path: str, raw: bytes, how: str) -> str:
    """The status code as text, or what happened instead."""
    if how in ("leave_after_send", "reset_after_send", "partial_body"):
        _leave(base, path, raw, how)
        return how
    try:
        with client.stream("POST", base + path, content=raw, headers={"content-type": "application/json"}) as r:
            for i, line in enumerate(r.iter_lines()):
                assert "engine_dead" not in line and "server_error" not in line, line
                if how == "leave_mid_stream" and i >= 1:
                    return f"{r.status_code}+left"
            return str(r.status_code)
    except httpx.TimeoutException:
        return "client_timeout"


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_hostile_bodies_never_5xx_and_leave_the_engine_clean(server):
    base, llm, errors = server
    outcomes: collections.Counter[str] = collections.Counter()
    with httpx.Client(timeout=60) as client:

        @FUZZ
        @given(case=bodies())
        def one(case: tuple[str, bytes, str]) -> None:
            path, raw, how = case
            outcome = _send(client, base, path, raw, how)
            outcomes[outcome] += 1
            assert not outcome[:1] == "5", (outcome, path, raw[:300])

        one()
    print(f"\n{sum(outcomes.values())} hostile bodies: {dict(sorted(outcomes.items()))}")

    for _ in range(600):  # left clients are noticed and aborted; stragglers finish (max_tokens is small)
        st_ = llm.stats()
        if llm.num_in_flight == 0 and st_.num_running == 0 and st_.num_waiting == 0:
            break
        time.sleep(0.1)
    r = httpx.post(
        base + "/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert llm.error is None and httpx.get(base + "/health").status_code == 200
    st_ = llm.stats()
    assert st_.num_running == 0 and st_.num_waiting == 0 and st_.num_free_blocks == st_.num_total_blocks
    metrics = httpx.get(base + "/metrics").text
    assert _metric(metrics, 'slotune_http_responses_total{status="5xx"}') == 0
    assert _metric(metrics, 'slotune_http_responses_total{status="4xx"}') > 0
    assert errors.records == []
