"""Incremental detokenization with stop strings that may span several tokens."""

from __future__ import annotations

from typing import Any, Sequence


class StreamDecoder:
    """Turns a growing list of token ids into text chunks safe to print.

    Holds back a possibly incomplete UTF-8 character and any tail that could still become
    a stop string; on a stop string, the text before it is released and the rest dropped.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped_at: int | None = None

    @property
    def total_tokens(self) -> int:
        return len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def feed(self, new_ids: Sequence[int]) -> tuple[str, int | None]:
        self.ids.extend(new_ids)
        text = self._decode(self.ids)
        if self.stop_strings:
            start = max(0, self.emitted - self.hold)
            hits = [i for i in (text.find(s, start) for s in self.stop_strings) if i >= 0]
            if hits:
                self.stopped_at = min(hits)
                out = text[self.emitted : self.stopped_at]
                self.emitted = self.stopped_at
                return out, self.stopped_at
        safe = len(text) - self.hold
        while safe > self.emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.emitted:
            return "", None
        out = text[self.emitted : safe]
        self.emitted = safe
        return out, None

    def token_count_for_stop(self) -> int:
        """The fewest leading tokens whose text already contains a stop string."""
        for n in range(1, len(self.ids) + 1):
            text = self._decode(self.ids[:n])
            if any(s in text for s in self.stop_strings):
                return n
        return len(self.ids)

    def flush(self) -> str:
        if self.stopped_at is not None:
            return ""
        text = self._decode(self.ids)
        out = text[self.emitted :]
        self.emitted = len(text)
        return out
