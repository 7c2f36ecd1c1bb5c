"""OpenAI-shaped response bodies and stream chunks for chat and text completions."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

FINISH = {"eos": "stop", "stop_token": "stop", "stop_string": "stop", "max_new_tokens": "length",
          "context_length": "length"}


def finish_reason(stop_reason: str | None) -> str:
    return FINISH.get(stop_reason or "", "stop")


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n".encode()


@dataclass
class Shape:
    """The fixed parts of one request's response: chat or text completion."""

    chat: bool
    model: str
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, stream: bool, first: bool = False) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if stream:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def full(self, text: str, finish: str, usage: dict, extra: dict) -> dict[str, Any]:
        return {**self._head(False), "choices": [self._choice(text, finish, False)], "usage": usage,
                "speculant": extra}

    def chunk(self, text: str | None, first: bool = False) -> dict[str, Any]:
        body = {**self._head(True), "choices": [self._choice(text, None, True, first)]}
        if self.include_usage:
            body["usage"] = None
        return body

    def last(self, finish: str, extra: dict) -> dict[str, Any]:
        body = {**self._head(True), "choices": [self._choice(None if self.chat else "", finish, True)],
                "speculant": extra}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: leading prompt tokens restored from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}
