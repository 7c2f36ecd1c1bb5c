"""Drift detection for the adaptive verifier: has the acceptance level changed abruptly?

Exponentially forgotten acceptance counts follow a sudden change slowly when many block
positions add up; this compares a short window of realized tokens per cycle with the
distributions the model predicted for those cycles and reports a change only when a
likelihood-ratio test says the window is far better explained by a constant new level.
"""

from __future__ import annotations

import math
from typing import Sequence

from speculant.core.lookup import PromptLookup


class DriftDetector:
    """Notices when the realized tokens per cycle leave what the model predicted.

    Smoothed acceptance reacts slowly when many positions add up (a full block that stops being
    accepted still predicts many tokens for a while). Over the last ``WINDOW`` speculative
    cycles it screens the realized total against the model's mean and variance (more than
    ``Z`` standard deviations and half a token per cycle away), then compares the likelihood of the
    window under the model's per-cycle predictions with its likelihood under the best constant
    conditional acceptance rate; a ratio below ``RATIO`` is a change, and that rate
    (``last_rate``) the new level.
    """

    WINDOW = 3
    Z = 2.0
    RATIO = 1e-2

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window: list[tuple[int, list[float], float, float]] = []
        self.last_realized = self.last_predicted = 0.0
        self.last_rate = 0.0

    def update(self, realized: int, pmf: list[float]) -> str | None:
        """``pmf[t - 1]`` = P(t tokens) predicted for this cycle; ``realized`` tokens came."""
        self.window = self.window[1 - self.WINDOW:] + [(realized, pmf, *moments(pmf))]
        if len(self.window) < self.WINDOW:
            return None
        diff = sum(r - mean for r, _, mean, _ in self.window)
        var = sum(v for _, _, _, v in self.window)
        if abs(diff) <= max(self.Z * math.sqrt(var), 0.5 * self.WINDOW):
            return None
        model = math.fsum(math.log(max(q[r - 1], 1e-300)) for r, q, _, _ in self.window)
        rate, best = constant_rate_fit([(r, len(q) - 1) for r, q, _, _ in self.window])
        if model - best >= math.log(self.RATIO):
            return None
        predicted = sum(mean for _, _, mean, _ in self.window) / self.WINDOW
        realized_mean = sum(r for r, _, _, _ in self.window) / self.WINDOW
        self.reset()
        self.last_realized, self.last_predicted, self.last_rate = realized_mean, predicted, rate
        return "dropped" if diff < 0 else "rose"


def constant_rate_fit(cycles: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """The constant conditional acceptance rate that best explains ``(tokens, submitted)``
    cycles, and its log-likelihood.

    A cycle that committed t tokens of n submitted drafts accepted t - 1 drafts and rejected one
    unless t - 1 = n, so the likelihood is a^accepted (1 - a)^rejected and the maximum is at
    accepted / (accepted + rejected). Cycles of different widths (warm-up, probes) count each
    draft they reached, where a median of tokens per cycle would mix widths.
    """
    accepted = sum(t - 1 for t, _ in cycles)
    rejected = sum(1 for t, n in cycles if t - 1 < n)
    if accepted + rejected == 0:
        return 1.0, 0.0
    rate = accepted / (accepted + rejected)
    return rate, _xlogy(accepted, rate) + _xlogy(rejected, 1.0 - rate)


def _xlogy(x: float, y: float) -> float:
    return 0.0 if x == 0 else x * math.log(y)


def token_distribution(probs: Sequence[float]) -> list[float]:
    """P(t tokens committed), t = 1..n+1, when submitting n = len(probs) drafts with
    conditional acceptance ``probs``: P(t) = S_{t-1} - S_t (S_0 = 1, S_{n+1} = 0)."""
    out, survive = [], 1.0
    for p in probs:
        out.append(survive * (1.0 - p))
        survive *= p
    out.append(survive)
    return out


def moments(pmf: Sequence[float]) -> tuple[float, float]:
    mean = sum(t * q for t, q in enumerate(pmf, start=1))
    square = sum(t * t * q for t, q in enumerate(pmf, start=1))
    return mean, max(square - mean * mean, 0.0)


class RepeatWatch:
    """Notices when a request's committed output repeats an earlier span of itself.

    Small models decoding greedily often fall into loops, and a loop is the easiest text a
    drafter sees: while speculation is off, a repeat is a free hint that a probe may now pass.
    A hit is the latest ``SPAN`` tokens equal to ``SPAN`` tokens committed earlier.
    """

    SPAN = 8

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._spans = PromptLookup(self.SPAN, self.SPAN)  # prompt lookup's index of earlier spans

    def add(self, token_ids: Sequence[int]) -> bool:
        """Take a cycle's committed tokens; True when one of them completed a repeated span."""
        hit = False
        for t in token_ids:
            self._spans.extend([t])
            hit = hit or self._spans.match() is not None
        return hit
