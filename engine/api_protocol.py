"""OpenAI-compatible request bodies and error responses for `tune serve`.

Validated once, here, so nothing a client sends can reach the engine loop in a shape that
would crash it (an out-of-range seed or top_k used to kill the loop for every request).
Unknown fields are allowed because OpenAI clients send many optional ones; the ones we
cannot honour are rejected by name instead of being silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256

# Fields OpenAI defines that we do not implement; a non-default value is a 400 naming it.
UNSUPPORTED = ("logprobs", "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "echo",
               "suffix", "tools", "functions", "tool_choice", "function_call")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
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

    def unsupported_field(self) -> str | None:
        """The first OpenAI field set to something we cannot honour, if any."""
        extra = self.model_extra or {}
        for name in UNSUPPORTED:
            if extra.get(name) not in (None, False, 0, 0.0, [], {}):
                return name
        if self.best_of not in (None, 1):
            return "best_of"
        return None

    @property
    def num_max_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 16

    @property
    def is_usage_streamed(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


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


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""
    body: dict[str, Any] = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(message naming each bad field, first bad field) from pydantic errors; never echoes input."""
    def loc(e: dict[str, Any]) -> str:
        # Drop "body" and pydantic's union-branch tags ("str", "list[int]") from the path.
        parts = [str(p) for p in e.get("loc", ()) if p != "body" and not str(p).startswith(("str", "list["))]
        return ".".join(parts)

    if any(e.get("type") == "json_invalid" for e in errors):
        return "request body is not valid JSON", None
    seen: dict[str, str] = {}
    for e in errors:
        seen.setdefault(loc(e), e.get("msg", "invalid value"))  # unions repeat one field per branch
    message = "; ".join(f"{k}: {v}" if k else v for k, v in seen.items())
    return message or "invalid request", next(iter(seen), None) or None
