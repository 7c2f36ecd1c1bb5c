"""Incremental detokenization with stop strings that may span several tokens."""

from __future__ import annotations

from typing import Any, Sequence

# Tokens re-decoded before the unsettled tail: enough context for tokenizers whose decode of a
# slice differs at its start (SentencePiece drops a leading space), as in vLLM's detokenizer.
_CONTEXT_TOKENS = 5


class StreamDecoder:
    """Turns a growing list of token ids into text chunks safe to print.

    Holds back a possibly incomplete UTF-8 character and any tail that could still become
    a stop string; on a stop string, the text before it is released and the rest dropped.
    Each feed decodes only the tokens since the last settled character (plus a little
    context), so a long generation costs linear, not quadratic, decoding.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped_at: int | None = None
        self._settled = ""  # text of ids[:self._read], ending on a complete character
        self._prefix = 0  # ids[_prefix:_read] are the context re-decoded before the tail
        self._read = 0
        self._fed_before = 0

    @property
    def total_tokens(self) -> int:
        return len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _text(self) -> str:
        """The text of all ids so far, settling the tail when it ends on a complete character."""
        context = self._decode(self.ids[self._prefix : self._read])
        tail = self._decode(self.ids[self._prefix :])[len(context) :]
        if tail.endswith("\ufffd"):
            return self._settled + tail
        self._settled += tail
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        return self._settled

    def feed(self, new_ids: Sequence[int]) -> tuple[str, int | None]:
        self._fed_before = len(self.ids)
        self.ids.extend(new_ids)
        text = self._text()
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
        """The fewest leading tokens whose text already contains a stop string.

        Earlier feeds found none, so the count lies among the tokens of the last feed.
        """
        for n in range(self._fed_before + 1, len(self.ids) + 1):
            text = self._decode(self.ids[:n])
            if any(s in text for s in self.stop_strings):
                return n
        return len(self.ids)

    def flush(self) -> str:
        if self.stopped_at is not None:
            return ""
        text = self._text()
        out = text[self.emitted :]
        self.emitted = len(text)
        return out
