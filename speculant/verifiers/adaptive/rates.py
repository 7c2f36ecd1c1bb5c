"""The two pure decisions behind every width: the best rate and the best width for a known rate.

``gains[n]`` = E(n), the expected tokens committed when submitting n drafts
(:func:`~speculant.verifiers.adaptive.acceptance.expected_tokens`); ``costs[n]`` = T(n+1), the
target forward of width n + 1.
"""

from __future__ import annotations

from typing import Sequence


def best_rate(gains: Sequence[float], costs: Sequence[float], draft: float | Sequence[float],
              rest: float) -> tuple[float, int]:
    """The best speculative tokens per second and its n >= 1: max_n E(n) / (D + T(n+1) + R).

    ``draft``: one cost for every n, or D(n) per n (a draft of exactly n tokens). Ties go to the
    smaller n.
    """
    drafts = [draft] * len(gains) if isinstance(draft, (int, float)) else draft
    best, best_n = 0.0, 0
    for n in range(1, len(gains)):
        rate = gains[n] / max(drafts[n] + costs[n] + rest, 1e-12)
        if rate > best * (1.0 + 1e-12):
            best, best_n = rate, n
    return best, best_n


def best_width(gains: Sequence[float], costs: Sequence[float], rate: float) -> int:
    """The n in 0..k maximising E(n) - rate * T(n+1) (ties go to the smaller n).

    The renewal-reward (Dinkelbach) form of maximising tokens per second once the draft is
    paid for: at the long-run ``rate`` it picks the n of the rate comparison.
    """
    best, best_value = 0, gains[0] - rate * costs[0]
    for n in range(1, len(gains)):
        value = gains[n] - rate * costs[n]
        if value > best_value + 1e-12 * max(1.0, abs(best_value)):
            best, best_value = n, value
    return best
