"""A request in the scheduler (core/scheduler.py): its loop and the text stream it sends; its
prompt ids, checked, and a batch's errors numbered by prompt."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Any, Callable, Sequence

from speculant.core.errors import ContextTooLongError, SettingError
from speculant.core.text import StreamDecoder
from speculant.core.types import Chunk

if TYPE_CHECKING:
    from speculant.core.loop import Loop


class Request:
    """One request in the scheduler: its loop (the sequence's state) and its text stream."""

    def __init__(self, loop: "Loop", stop_strings, key: object = None) -> None:
        self.loop = loop
        self.key = key if key is not None else id(self)
        self.decoder = StreamDecoder(loop.e.tokenizer, stop_strings)
        self.error: BaseException | None = None
        self._final: Chunk | None = None

    def chunk(self, new_ids: list[int]) -> Chunk | None:
        """The text of ``new_ids``, cut where a stop string ended (the request then stops)."""
        text, hit = self.decoder.feed(new_ids)
        if hit is not None:
            self.loop.stop("stop_string")
            kept = self.decoder.token_count_for_stop()
            self.loop.truncate(kept)
            new_ids = new_ids[: max(0, len(new_ids) - (self.decoder.total_tokens - kept))]
        return Chunk(text, list(new_ids)) if text or new_ids else None

    def final(self) -> Chunk:
        """The last chunk: the text still held back, the finish reason, the stats (once)."""
        if self._final is None:
            self.loop.finish()
            stats = self.loop.stats
            self._final = Chunk(self.decoder.flush(), [], stats.stop_reason, stats, self.error)
        return self._final


def checked_ids(values: Sequence[int]) -> list[int]:
    """Integer token ids; floats and bools are refused rather than converted with ``int()``."""
    if isinstance(values, (str, bytes)):
        raise SettingError("prompt_ids: must be a sequence of integer token ids, not a string", "prompt_ids")
    if isinstance(values, (Set, Mapping)):  # no order to read the prompt in
        raise SettingError(f"prompt_ids: must be an ordered sequence of integer token ids (a list), not a "
                           f"{type(values).__name__}", "prompt_ids")
    try:
        items = list(values)
    except TypeError:
        raise SettingError(f"prompt_ids: must be a sequence of integer token ids, got {type(values).__name__}",
                           "prompt_ids") from None
    ids = []
    for t in items:
        if isinstance(t, bool) or "bool" in type(t).__name__ or "bool" in str(getattr(t, "dtype", "")):
            raise SettingError(f"prompt_ids: must hold integer token ids, got a boolean {t!r}", "prompt_ids")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise SettingError(f"prompt_ids: must hold integer token ids, got {t!r} ({type(t).__name__})",
                               "prompt_ids") from None
    return ids


def numbered(make: Callable[[int, Any], Any], values: Sequence[Any]) -> list[Any]:
    """``make(index, value)`` for each of ``values``; a bad one's error names its index
    (``prompt 3: ...``), so a batch's caller knows which prompt to fix."""
    out = []
    for i, value in enumerate(values):
        try:
            out.append(make(i, value))
        except (SettingError, ContextTooLongError) as exc:
            exc.args = (f"prompt {i}: {exc.args[0]}", *exc.args[1:])
            raise
    return out
