"""Request bodies of the OpenAI API as pydantic models, and the OpenAI error body.

Unknown fields are refused (as OpenAI does), except the few clients send by default and that
change nothing here; ranges follow OpenAI's, ``top_k`` follows vLLM's (-1 or 0 = off). Types are
strict: ``true`` is no integer, ``"16"`` no number, ``1`` no boolean (an integer is a number, as
JSON has it: ``temperature: 1`` is 1.0); NaN and infinities are refused.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, Field, ValidationError, field_validator

from speculant.core.config import MIN_TEMPERATURE  # the engine's own floor: one rule for every caller
from speculant.core.schema import UserModel


class ApiError(Exception):
    """An error the server answers with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


CLIENT_LEFT = 499  # the status counted for a client that closed its connection (nginx's convention)


def client_left(when: str) -> ApiError:
    return ApiError(CLIENT_LEFT, f"the client closed the connection {when}", code="client_closed")


class StreamOptions(UserModel):
    include_usage: bool = False


class _Common(UserModel):

    model: str
    max_tokens: int | None = Field(None, ge=1)
    # None: the engine config's sampling settings (greedy for the named pairs)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0)
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0)

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_TEMPERATURE:  # logits / 1e-320 overflow: a 500 mid-request
            raise ValueError(f"give 0 for greedy decoding or at least {MIN_TEMPERATURE:g}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Any) -> Any:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return value

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """The engine.generate overrides this request sets."""
        out: dict[str, Any] = {"stop_strings": self.stop_strings()}
        for key in ("temperature", "top_p", "seed"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.top_k is not None:
            out["top_k"] = max(0, self.top_k)  # vLLM's -1 is speculant's 0: off
        return out


class ChatMessage(UserModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value


def read_json(data: bytes) -> Any:
    """The request body as JSON (pydantic's Rust parser: a depth limit instead of Python's
    RecursionError, no NaN or Infinity, no lone UTF-16 surrogates); a 400 ``invalid_json`` if not."""
    try:
        return pydantic_core.from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        problem = str(exc)
        hint = next((h for key, h in JSON_HINTS.items() if key in problem), "")
        raise ApiError(400, f"the request body is not valid JSON: {problem}{hint}", code="invalid_json") from None


JSON_HINTS = {
    "recursion limit": " (nested too deeply)",
    "surrogate": " (a lone UTF-16 surrogate such as \\ud800 is not text)",
    "hex escape": " (a lone UTF-16 surrogate such as \\ud800 is not text)",
    "unicode code point": " (not UTF-8 text)",
    "utf-8": " (not UTF-8 text)",
}


def parse(model: type[BaseModel], data: Any) -> Any:
    """``model.model_validate(data)``; the first field's problems as a 400 naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = errors[0]
        param = str(err["loc"][0]) if err["loc"] else None  # the request field, not a union member's tag
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"Unrecognized request argument supplied: {param}", param=param,
                           code="unrecognized_argument") from None
        # a union field (prompt, stop, content) fails once per member: say what each wanted
        same = [e for e in errors if e["loc"][:1] == err["loc"][:1]][:3]
        message = "; or ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in same)
        raise ApiError(400, message, param=param, code=err["type"]) from None
