"""`tune serve` against hostile bodies: invalid Unicode, OpenAI fields we do not honour, and the
default bound on requests the server holds. A real uvicorn server on a loopback port."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from slotune.engine import EngineConfig
from slotune.engine.serving.async_llm import AsyncLLM
from slotune.engine.serving.api_protocol import IGNORED, REJECTED_UNLESS_DEFAULT, ChatRequest, CompletionRequest
from slotune.engine.config import DEFAULT_MAX_PENDING_REQUESTS
from slotune.engine.serving.server import build_app, serve_in_thread

MODEL = "smollm2-135m"
JSON = {"content-type": "application/json"}
MAX_NUM_SEQS, MAX_PENDING = 2, 2


@pytest.fixture(scope="module")
def server():
    cfg = EngineConfig(
        max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=64, max_model_len=512, admission={"max_pending_requests": MAX_PENDING}
    )
    llm = AsyncLLM(cfg)
    with serve_in_thread(llm, build_app(llm)) as base:
        yield base, llm


def _post(base: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(base + path, content=body, headers=JSON, timeout=60)


def _alive(base: str, llm: AsyncLLM) -> None:
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert llm.error is None


# --- 1. invalid Unicode -----------------------------------------------------------------------
COMPLETION = b'{"model": "smollm2-135m", "max_tokens": 1, %s}'
CHAT = b'{"model": "smollm2-135m", "max_tokens": 1, "messages": [%s]}'


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", COMPLETION % b'"prompt": "a\\ud800b"', "prompt"),
        ("/v1/completions", COMPLETION % b'"prompt": ["\\udfff"]', "prompt.0"),
        ("/v1/completions", COMPLETION % b'"prompt": "hi", "stop": ["x", "\\udbff"]', "stop.1"),
        ("/v1/completions", b'{"model": "smollm2-135m\\ud800", "prompt": "hi"}', "model"),
        ("/v1/chat/completions", CHAT % b'{"role": "user", "content": "\\ud800"}', "messages.0.content"),
        (
            "/v1/chat/completions",
            CHAT % b'{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", CHAT % b'{"role": "user", "content": "hi", "name": "\\ud83d"}', "messages.0.name"),
        ("/v1/chat/completions", CHAT % b'{"role": "user", "content": "hi", "\\ud800": 1}', "messages.0"),
    ],
    ids=["prompt", "prompt-list", "stop", "model", "chat-content", "chat-part", "chat-name", "chat-key"],
)
def test_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    base, llm = server
    r = _post(base, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":") and "surrogate" in err["message"]
    _alive(base, llm)


def test_a_valid_surrogate_pair_and_other_unicode_still_work(server):
    base, _ = server
    r = _post(base, "/v1/completions", COMPLETION % b'"prompt": "emoji \\ud83d\\ude00 caf\\u00e9 \\u0000 \xe2\x9c\x93"')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "body, words",
    [
        (b'{"model": "smollm2-135m", "prompt": "a\xff\xfeb"}', "not valid UTF-8"),
        (b'{"model": "smollm2-135m", "prompt": "hi", "temperature": NaN}', "NaN"),
        (b'{"model": "smollm2-135m", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "digits"),
        (b'{"model": "smollm2-135m", "prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests deeper"),
        (b'{"model": "smollm2-135m", "prompt": "hi", "metadata": ' + b'{"a":' * 40 + b"1" + b"}" * 41, "nested deeper"),
        (b'\xef\xbb\xbf{"model": "smollm2-135m", "prompt": "hi"}', "not valid JSON"),
        (b"", "not valid JSON"),
        (b'"just a string"', "valid dictionary"),
    ],
)
def test_malformed_bodies_are_400s_that_say_why(server, body, words):
    base, llm = server
    r = _post(base, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    _alive(base, llm)


# --- 2. OpenAI fields we do not honour ----------------------------------------------------------
NOT_DEFAULT = {
    "logprobs": True,
    "top_logprobs": 3,
    "logit_bias": {"50256": -100},
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "echo": True,
    "suffix": "end",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "functions": [{"name": "f"}],
    "tool_choice": "required",
    "function_call": {"name": "f"},
    "response_format": {"type": "json_object"},
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "moderation": {"input": {"policy": "x"}},
    "store": True,
    "service_tier": "flex",
}
IGNORED_VALUES = {
    "user": "u-1",
    "safety_identifier": "h-1",
    "metadata": {"k": "v"},
    "prompt_cache_key": "c",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"},
    "parallel_tool_calls": False,
}


def test_every_openai_request_field_is_classified():
    """Honoured, rejected unless default, or ignored as harmless: a new SDK field fails here first."""
    openai = pytest.importorskip("openai")
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    honoured = set(CompletionRequest.model_fields) | set(ChatRequest.model_fields)
    for params in (completion_create_params.CompletionCreateParamsBase, chat_params.CompletionCreateParamsBase):
        fields = set(params.__required_keys__) | set(params.__optional_keys__)
        assert fields - honoured - set(REJECTED_UNLESS_DEFAULT) - IGNORED == set(), openai.__version__
    assert set(NOT_DEFAULT) == set(REJECTED_UNLESS_DEFAULT) and set(IGNORED_VALUES) == IGNORED


@pytest.mark.parametrize("field", sorted(NOT_DEFAULT))
def test_unhonoured_fields_are_rejected_by_name(server, field):
    base, _ = server
    for path, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = httpx.post(
            base + path, json={"model": MODEL, "max_tokens": 1, **body, field: NOT_DEFAULT[field]}, timeout=60
        )
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and f"'{field}'" in err["message"] and err["code"] == "unsupported_parameter"


def test_unknown_fields_are_rejected_by_name(server):
    base, _ = server
    for field in ("max_token", "repetition_penalty", "guided_json"):
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "hi", field: 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = httpx.post(
        base + "/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.x", r.text


def test_defaults_and_harmless_fields_keep_working(server):
    base, _ = server
    defaults = {
        "logprobs": False,
        "top_logprobs": 0,
        "logit_bias": {},
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "modalities": ["text"],
        "store": False,
        "service_tier": "auto",
        "audio": None,
        "best_of": 1,
        "n": 1,
    }
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0,
        "seed": 3,
        "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}],
        **defaults,
        **IGNORED_VALUES,
    }
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    with httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]


def test_openai_client_gets_a_bad_request_for_response_format(server):
    openai = pytest.importorskip("openai")
    base, _ = server
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            response_format={"type": "json_object"},
        )
    assert info.value.body["param"] == "response_format"
    ok = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, user="u")
    assert ok.choices[0].message.content is not None


# --- 3. default admission bounds ----------------------------------------------------------------
def test_the_default_config_bounds_what_a_server_holds():
    adm = EngineConfig().admission
    assert adm.max_pending_requests == DEFAULT_MAX_PENDING_REQUESTS and 0 < DEFAULT_MAX_PENDING_REQUESTS <= 1024


def test_requests_beyond_the_bound_get_429_with_retry_after_and_places_come_back(server):
    base, llm = server
    limit = MAX_NUM_SEQS + MAX_PENDING
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 8, "ignore_eos": True}

    async def burst(n: int, stream: bool = False, leave_early: bool = False):
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:

            async def one():
                if not stream:
                    return (await c.post("/v1/completions", json=body)).status_code
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        if leave_early:
                            break  # the client goes away mid-stream
                    return r.status_code

            return await asyncio.gather(*(one() for _ in range(n)))

    for stream, leave_early in ((False, False), (True, False), (True, True)):
        codes = asyncio.run(burst(3 * limit, stream, leave_early))
        assert set(codes) == {200, 429} and codes.count(200) >= limit, codes
    for _ in range(100):  # an early leaver's place comes back once the server sees it gone
        st = llm.stats()
        if llm.num_in_flight == 0 and st.num_running == 0 and st.num_waiting == 0:
            break
        time.sleep(0.1)
    # every place came back: `limit` requests at once are all admitted
    assert asyncio.run(burst(limit)) == [200] * limit
    m = httpx.get(base + "/metrics").text
    assert 'slotune_requests_rejected_total{reason="queue_full"}' in m
    st = llm.stats()
    assert st.num_running == 0 and st.num_waiting == 0 and st.num_free_blocks == st.num_total_blocks


def test_429_names_the_bound_and_sets_retry_after(server):
    base, _ = server
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=base, timeout=120) as c:
            return await asyncio.gather(
                *(c.post("/v1/completions", json=body) for _ in range(2 * (MAX_NUM_SEQS + MAX_PENDING)))
            )

    refused = [r for r in asyncio.run(burst()) if r.status_code == 429]
    assert refused
    for r in refused:
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "queue_full" and "admission.max_pending_requests" in err["message"]
