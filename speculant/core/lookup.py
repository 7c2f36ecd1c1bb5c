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
    """Token history of one request with, per n-gram length, where the current suffix last occurred."""

    def __init__(self, min_match: int, max_match: int) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"prompt lookup needs 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.reset([])

    def reset(self, token_ids: Sequence[int]) -> None:
        self.history: list[int] = []
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._previous: dict[int, int] = {}  # n -> end of the suffix n-gram's earlier occurrence
        self.extend(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            self.history.append(int(t))
            end = len(self.history) - 1
            self._previous = {}
            for n in range(self.min_match, min(self.max_match, end + 1) + 1):
                gram = tuple(self.history[end - n + 1:])
                earlier = self._latest.get(gram)
                if earlier is not None:
                    self._previous[n] = earlier
                self._latest[gram] = end

    def propose(self, k: int) -> list[int] | None:
        """``k`` tokens copied after the longest matching suffix, or None when none matches.

        A match ``p`` tokens back continues periodically past the end of the history (a loop of
        period ``p`` repeats)."""
        match = next((self._previous[n] for n in range(self.max_match, self.min_match - 1, -1)
                      if n in self._previous), None)
        if match is None or k < 1:
            return None
        tokens = self.history[match + 1: match + 1 + k]
        period = len(self.history) - 1 - match
        while len(tokens) < k:
            tokens.append(tokens[len(tokens) - period])
        return tokens
