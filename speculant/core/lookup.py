"""Prompt lookup: draft by copying what followed the latest earlier occurrence of the context's
last n tokens (n from ``max_match`` down to ``min_match``), as prompt-lookup decoding does.

Small models decoding greedily fall into loops of text they made up; a trained drafter cannot
predict those, but the context holds them. A copy costs no forward, and verification stays the
target's, so output is unchanged. Host-side and backend-neutral: token ids in, token ids out.
With no drafter configured it is prompt-lookup decoding on its own: plain steps where nothing matches.
"""

from __future__ import annotations

from typing import Sequence

DEFAULT_BLOCK_SIZE = 8  # verify width (anchor + copies) when lookup runs without a drafter


class PromptLookup:
    """Token history of one request, indexed by every ``min_match``..``max_match``-gram whose next
    token is known (so the current suffix is found only where it occurred before)."""

    def __init__(self, min_match: int, max_match: int, token_ids: Sequence[int] = ()) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"prompt lookup needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.reset(token_ids)

    def reset(self, token_ids: Sequence[int]) -> None:
        self.history: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        h = self.history
        for t in token_ids:
            end = len(h) - 1  # the last token now gets a successor: index the n-grams ending at it
            for n in range(self.min_match, min(self.max_match, end + 1) + 1):
                self._ends[tuple(h[end - n + 1:])] = end
            h.append(int(t))

    def match(self) -> int | None:
        """Where the longest suffix of ``max_match``..``min_match`` tokens last ended before, or None."""
        h = self.history
        for n in range(min(self.max_match, len(h)), self.min_match - 1, -1):
            end = self._ends.get(tuple(h[-n:]))
            if end is not None:
                return end
        return None

    def propose(self, k: int) -> list[int] | None:
        """``k`` tokens copied after the longest matching suffix, or None when none matches.

        A match ``p`` tokens back continues periodically past the end of the history (a loop of
        period ``p`` repeats)."""
        match = self.match() if k >= 1 else None
        if match is None:
            return None
        tokens = self.history[match + 1: match + 1 + k]
        period = len(self.history) - 1 - match
        while len(tokens) < k:
            tokens.append(tokens[len(tokens) - period])
        return tokens
