"""Drift detection for the adaptive verifier: has the acceptance level changed abruptly?

Exponentially forgotten acceptance counts follow a sudden change slowly when many block
positions add up; this compares a short window of realized tokens per cycle with the
distributions the model predicted for those cycles and reports a change only when a
likelihood-ratio test says the window is far better explained by a constant new level.
"""

from __future__ import annotations

import math
from typing import Sequence


class DriftDetector:
    """Notices when the realized tokens per cycle leave what the model predicted.

    Smoothed acceptance reacts slowly when many positions add up (a full block that stops being
    accepted still predicts many tokens for a while). Over the last ``WINDOW`` speculative
    cycles it screens the realized total against the model's mean and variance (more than
    ``Z`` standard deviations and half a token per cycle away), then compares the likelihood of the
    window under the model's per-cycle predictions with its likelihood under the best constant
    conditional acceptance rate; a ratio below ``RATIO`` is a change, and ``last_realized``
    (the window's median) the new level.
    """

    WINDOW = 3
    Z = 2.0
    RATIO = 1e-2
    GRID = [i / 20 for i in range(21)]

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.window: list[tuple[int, list[float], float, float]] = []
        self.last_realized = self.last_predicted = 0.0

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
        best = max(
            math.fsum(math.log(max(token_distribution([a] * (len(q) - 1))[r - 1], 1e-300)) for r, q, _, _ in self.window)
            for a in self.GRID
        )
        if model - best >= math.log(self.RATIO):
            return None
        realized_level = sorted(r for r, _, _, _ in self.window)[self.WINDOW // 2]
        predicted = sum(mean for _, _, mean, _ in self.window) / self.WINDOW
        self.reset()
        self.last_realized, self.last_predicted = float(realized_level), predicted
        return "dropped" if diff < 0 else "rose"


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
