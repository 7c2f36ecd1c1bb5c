"""A multi-turn conversation over one engine (``engine.session()``).

Each turn sends the whole conversation so far, as a chat client would; the engine's prefix cache
(:mod:`speculant.core.prefix_cache`) restores what the earlier turns left in the caches, so only
the new part is prefilled. Two ways to hold the conversation:

- ``say(text)`` / ``stream(text)``: chat messages, rendered by the tokenizer's chat template each
  turn. A full-attention target reuses every token up to the first one the template renders
  differently; a target with sliding windows or Gated DeltaNet states resumes from the end of the
  previous turn's prompt (the template renders earlier turns the same way, so that prompt is a
  prefix of the next).
- ``extend(prompt_ids)``: token ids, appended to the conversation's ids (the earlier prompts and
  every token produced); the next turn resumes at the end of the previous output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from speculant.core.errors import SettingError
from speculant.core.types import Chunk

if TYPE_CHECKING:
    from speculant.core.engine import Engine, GenerationResult


class Session:
    """One conversation: its chat messages, or its token ids, and the engine that answers it."""

    def __init__(self, engine: "Engine", system: str | None = None) -> None:
        self.engine = engine
        self.messages: list[dict[str, str]] = [] if system is None else [{"role": "system", "content": system}]
        self.token_ids: list[int] = []  # ids of the conversation held by ``extend``

    def say(self, text: str, **settings: Any) -> "GenerationResult":
        """Send a user message and return the whole reply (kept in ``messages``)."""
        return _collected(self.stream(text, **settings))

    def stream(self, text: str, **settings: Any) -> Iterator[Chunk]:
        """Send a user message; yield the reply chunk by chunk (kept in ``messages`` once it ends)."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = chat_ids(self.engine.tokenizer, messages, "session",
                       "hold the conversation as token ids with session.extend(prompt_ids)")
        reply = []
        with self.engine.generate(prompt_ids=ids, **settings) as generation:
            for chunk in generation:
                reply.append(chunk.text)
                yield chunk
        self.messages = messages + [{"role": "assistant", "content": "".join(reply)}]

    def extend(self, prompt_ids: Sequence[int], **settings: Any) -> "GenerationResult":
        """Append ``prompt_ids`` to the conversation's ids and generate after them; the output's
        ids are appended too, so the next call continues the conversation."""
        return _collected(self.extend_stream(prompt_ids, **settings))

    def extend_stream(self, prompt_ids: Sequence[int], **settings: Any) -> Iterator[Chunk]:
        """:meth:`extend`, chunk by chunk (the ids are kept once the output ends)."""
        ids = self.token_ids + [int(t) for t in prompt_ids]
        with self.engine.generate(prompt_ids=ids, **settings) as generation:
            yield from generation
        self.token_ids = ids + generation.token_ids


def chat_ids(tokenizer: Any, messages: str | Sequence[Mapping[str, str]], where: str = "messages",
             instead: str = "give the prompt as text or token ids instead") -> list[int]:
    """The prompt ids of a chat: ``messages`` (role / content dicts, or one user message's text)
    rendered by the tokenizer's chat template, the assistant's turn opened. A SettingError (field
    ``prompt``; its message starting with ``where``, saying what to do ``instead``) where the
    tokenizer has no template, or where the template refuses the messages."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SettingError(f"{where}: the target's tokenizer has no chat template; {instead}", "prompt")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    try:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001  the template's own refusal (a role it does not know, ...)
        raise SettingError(f"{where}: the chat template cannot render these messages: {exc}", "prompt") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _collected(chunks: Iterator[Chunk]) -> "GenerationResult":
    from speculant.core.engine import GenerationResult

    parts = list(chunks)
    return GenerationResult("".join(c.text for c in parts), [t for c in parts for t in c.token_ids], parts[-1].stats)
