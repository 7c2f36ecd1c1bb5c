"""A request's prompt as token ids: rendered and tokenized in a thread of its own, never on the
event loop, after a cheap check that the text could fit the context window at all.

Tokenizing a million characters takes a second or more; on the event loop that second would
stall ``/health`` and every other client's stream.
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from speculant.serve.schemas import ApiError, ChatRequest

# A normalizer (NFC, NFKC) may merge characters before tokenizing: a Hangul syllable from three
# jamo is the largest merge Unicode composition makes, so allow 4 characters for each one kept.
NORMALIZER_MERGE = 4


class PromptReader:
    """Turns a completion's ``prompt`` or a chat's ``messages`` into token ids."""

    def __init__(self, tokenizer: Any, window: int | None) -> None:
        # The engine's thread decodes with its tokenizer while requests are tokenized here: a
        # copy of their own, since a fast tokenizer refuses concurrent use ("Already borrowed");
        # one thread, so this copy is never used by two requests at once either.
        self.tokenizer = copy.deepcopy(tokenizer)
        self.window = window
        self.max_chars = None if window is None else window * _chars_per_token_bound(self.tokenizer)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="speculant-tokenizer")

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def ids(self, req: Any, chat: bool) -> list[int]:
        param = "messages" if chat else "prompt"
        if chat:
            ids = await self._in_thread(self._chat_ids, req)
        elif isinstance(req.prompt, str):
            self._check_chars(req.prompt, param)  # on the loop: a length, before any thread hop
            # with special tokens, as engine.generate(prompt) tokenizes it
            ids = await self._in_thread(self.tokenizer.encode, req.prompt)
        else:
            ids = list(req.prompt)
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        if self.window is not None and len(ids) >= self.window:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the model's context window is {self.window}",
                           param=param, code="context_length_exceeded")
        return ids

    async def _in_thread(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def _check_chars(self, text: str, param: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise ApiError(400, f"the prompt has {len(text)} characters: more than the model's context window of "
                           f"{self.window} tokens can hold with this tokenizer (at most {self.max_chars} characters)",
                           param=param, code="context_length_exceeded")

    def _chat_ids(self, req: ChatRequest) -> list[int]:
        text = self._render(req)
        self._check_chars(text, "messages")
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render(self, req: ChatRequest) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions with a text prompt",
                           param="messages", code="no_chat_template")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001  a template's own refusal (e.g. no system role)
            raise ApiError(400, f"cannot render the messages with the chat template: {exc}", param="messages") from None


def _chars_per_token_bound(tokenizer: Any) -> int:
    """At most how many prompt characters one token stands for: its longest vocabulary entry
    (a byte-level entry has one character per byte, and a character is at least one byte),
    times ``NORMALIZER_MERGE`` when a normalizer may merge characters first."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    merges = backend is None or backend.normalizer is not None  # a slow tokenizer: assume it may
    return max(1, longest) * (NORMALIZER_MERGE if merges else 1)
