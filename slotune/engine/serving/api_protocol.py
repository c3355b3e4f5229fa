"""OpenAI-compatible request bodies and error responses for `tune serve`.

Validated once, here, so nothing a client sends reaches the engine loop in a shape that would crash
it. Bodies are parsed as strict JSON (UTF-8, no NaN, bounded nesting, no lone UTF-16 surrogates), so
every malformed body is a 400 naming the field. Every field of OpenAI's completions and chat-completions
requests (openai-python 3.57) is honoured (declared below), rejected by name unless it asks for nothing
(`REJECTED_UNLESS_DEFAULT`), or ignored because it cannot change what is generated (`IGNORED`); any
other top-level field is an error, so a typo (`max_token`) never silently falls back to a default.
Message objects keep their extra fields (`name`, `tool_calls`, ...): chat templates read them.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Literal, TypeVar

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256
MAX_JSON_DEPTH = 32  # a chat body nests 5 deep (messages.0.content.0.text); tool schemas are refused anyway
MAX_MODEL_CHARS = 1024

# OpenAI fields we do not implement -> the values that ask for nothing (None always does).
# Any other value is a 400 naming the field: each would change what is generated or returned.
REJECTED_UNLESS_DEFAULT: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,),  # completions: an int (0 still asks for the sampled token's logprob)
    "top_logprobs": (0,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),  # without tools neither can call anything
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),  # json_object / json_schema: no constrained decoding here
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "moderation": (),
    "store": (False,),  # nothing is stored
    "service_tier": ("auto", "default"),
}
# Accepted and ignored: they name the caller or hint at caching, never change the output.
IGNORED = frozenset(
    {
        "user",
        "safety_identifier",
        "metadata",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "parallel_tool_calls",
    }
)


class InvalidRequest(ValueError):
    """A body this server refuses (400): `message` names the field, `param` is its dotted path."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool = True  # accepted, ignored: no obfuscation padding is added to chunks


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(max_length=MAX_MODEL_CHARS)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT64_MAX, description="0 or -1 = off (the vLLM convention)")
    n: int = Field(1, ge=1, le=128)
    best_of: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(stops)}")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each stop sequence must be 1..{MAX_STOP_CHARS} characters, got {len(s)}")
        return stops

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, message) for the first field we cannot honour or do not know, if any."""
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED:
                continue
            shown = name if len(name) <= 64 else name[:64] + "..."
            if name not in REJECTED_UNLESS_DEFAULT:
                return shown, f"'{shown}' is not a field of this API (OpenAI completions/chat completions)"
            if not _asks_for_nothing(value, REJECTED_UNLESS_DEFAULT[name]):
                return name, f"'{name}' is not supported by this server"
        if self.best_of not in (None, 1):
            return "best_of", "'best_of' is not supported by this server"
        return None

    @property
    def num_max_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    @property
    def is_usage_streamed(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _asks_for_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    # True == 1 in Python: a bool only matches a bool default, a number only a number.
    return value is None or any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] = Field(min_length=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError(f"batched prompts are not supported ({len(v)} given); send one prompt per request")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def as_template_input(self) -> dict[str, Any]:
        """The message as transformers hands it to a chat template: every field the client sent
        (templates read e.g. `tool_calls` or `name` when present), text parts joined into one string."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": text}


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)


R = TypeVar("R", bound=_Request)


def parse_request(body: bytes, model: type[R]) -> R:
    """The validated request in `body`.

    Raises:
        InvalidRequest: not UTF-8, not strict JSON, nested deeper than MAX_JSON_DEPTH, a string
            holding a lone surrogate, or a field that fails validation; the message names it.
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidRequest(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        ) from None
    except ValueError as exc:  # NaN/Infinity (parse_constant), an integer of over 4300 digits
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    _check_text(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(*validation_message(list(exc.errors()))) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _check_text(data: Any) -> None:
    """Raise InvalidRequest naming the first string (or key) that is not valid Unicode, or the
    first container nested deeper than MAX_JSON_DEPTH. Iterative: depth cannot overflow the stack."""
    if isinstance(data, str):
        _check_str(data, ())
    stack: list[tuple[Any, tuple, int]] = [(data, (), 0)] if isinstance(data, (dict, list)) else []
    while stack:
        value, path, depth = stack.pop()
        if depth >= MAX_JSON_DEPTH:
            raise InvalidRequest(f"{_dotted(path)}: nested deeper than {MAX_JSON_DEPTH} levels", _dotted(path) or None)
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if isinstance(key, str):
                _check_str(key, path, is_key=True)
            if isinstance(item, str):
                _check_str(item, (*path, key))
            elif isinstance(item, (dict, list)):
                stack.append((item, (*path, key), depth + 1))


def _check_str(s: str, path: tuple, is_key: bool = False) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")  # fails only on a surrogate code point (U+D800..U+DFFF)
    except UnicodeEncodeError:
        where = _dotted(path) or "request body"
        what = "a field name" if is_key else "the text"
        raise InvalidRequest(
            f"{where}: {what} holds a lone UTF-16 surrogate (an escape like \\ud800 without "
            "its pair), which is not valid Unicode",
            _dotted(path) or None,
        ) from None


def _dotted(path: tuple) -> str:
    return ".".join(str(p) if len(str(p)) <= 64 else str(p)[:64] + "..." for p in path)


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


UNAUTHORIZED = error_body(
    "invalid or missing API key (send 'Authorization: Bearer KEY')", "authentication_error", code="invalid_api_key"
)


def bearer_matches(authorization: bytes, key: bytes) -> bool:
    """Whether an Authorization header value is `Bearer <key>` (constant-time compare)."""
    token = authorization[7:] if authorization[:7].lower() == b"bearer " else b""
    return hmac.compare_digest(token, key)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message naming each bad field, first bad field) from pydantic errors; never echoes input."""

    def loc(e: dict[str, Any]) -> str:
        # Drop "body" and pydantic's union-branch tags ("str", "list[int]") from the path; not
        # "stream_options" or "stream", which a prefix test on "str" used to drop.
        parts = [str(p) for p in e.get("loc", ()) if p not in ("body", "str") and not str(p).startswith("list[")]
        return ".".join(parts)

    if any(e.get("type") == "json_invalid" for e in errors):
        return "request body is not valid JSON", None
    seen: dict[str, str] = {}
    for e in errors:
        seen.setdefault(loc(e), e.get("msg", "invalid value"))  # unions repeat one field per branch
    message = "; ".join(f"{k}: {v}" if k else v for k, v in seen.items())
    return message or "invalid request", next(iter(seen), None) or None
