"""The adaptive verifier's acceptance model: how likely each drafted position is accepted.

It estimates the survival S_j = P(the first j drafts are all accepted) for every block
position j from cycles that submitted at least j drafts, with exponentially forgotten counts
(``decay`` per cycle, observed or not) shrunk towards ``S_{j-1} * prior``, and kept
non-increasing in j. The prior is the long-run rate at which reached drafts were accepted
(forgotten a hundred times more slowly), starting from ``prior_acceptance``: after a long
fallback the estimates return to what this drafter usually achieves, not to a fixed guess. A position not submitted lately therefore drifts towards "as good as the
previous one, times the prior", and when the first positions collapse every deeper position
collapses with them at once (a conditional-rate model would keep trusting stale deep
positions). Conditional rates a_j = S_j / S_{j-1} give ``E(n) = 1 + sum_{j<=n} S_j``.

Draft confidence (``Draft.confidence``: a top-1 probability, a log-probability, a path score;
anything that grows with the drafter's certainty) is calibrated online instead of trusted:
confidences are mapped to [0, 1) and binned; per bin the model compares how often reached
drafts were accepted with how often the history-only a_j predicted, and shifts the log-odds of
a_j by that difference. Bins with little evidence shift nothing.

Counts are stored in units of ``1 / scale``: forgetting multiplies ``scale`` and new evidence
is added as ``1 / scale``, so a cycle costs O(1) whatever the block size. Calibration bins
have their own, slower scale (``confidence_decay``).
"""

from __future__ import annotations

import math
from typing import Sequence

BINS = 8
EPS = 1e-3
LONG_DECAY = 0.995  # per cycle, for the long-run acceptance rate that serves as the prior
LONG_WEIGHT = 2.0  # pseudo-draws of the initial prior in that long-run rate


def squash(value: float, scores: bool) -> float:
    """Map a confidence onto [0, 1) monotonically.

    Probabilities stay as they are, negative values are read as log-probabilities, and once a
    drafter has shown values above 1 (``scores``) every value is compressed by v / (1 + v).
    """
    if not math.isfinite(value):
        return 0.0
    if value < 0.0:
        value = math.exp(value)
    if scores:
        return value / (1.0 + value)
    return min(value, 0.999)


def logit(p: float) -> float:
    p = min(max(p, EPS), 1.0 - EPS)
    return math.log(p / (1.0 - p))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def expected_tokens(probs: Sequence[float]) -> list[float]:
    """E[tokens committed] when submitting n = 0..len(probs) drafts: 1 + sum_j prod_{i<=j} a_i."""
    out = [1.0]
    survive = 1.0
    for p in probs:
        survive *= p
        out.append(out[-1] + survive)
    return out


class AcceptanceModel:
    def __init__(self, decay: float = 0.95, prior: float = 0.5, prior_weight: float = 1.0,
                 confidence_weight: float = 4.0, confidence_decay: float = 0.99) -> None:
        self.decay = decay
        self.confidence_decay = confidence_decay
        self.initial_prior = prior
        self.prior = prior
        self.long_accepted = self.long_reached = 0.0  # every reached draft, forgotten slowly
        self.weight = prior_weight
        self.confidence_weight = confidence_weight
        self.survived: list[float] = []  # per position j: cycles that accepted >= j drafts
        self.tried: list[float] = []  # per position j: cycles that submitted >= j drafts
        self.bin_n = [0.0] * BINS  # per confidence bin: reached drafts,
        self.bin_x = [0.0] * BINS  # accepted ones,
        self.bin_e = [0.0] * BINS  # and the history-only prediction summed over them
        self.scores = False  # the drafter's confidences are unbounded scores, not probabilities
        self.scale = 1.0
        self.bin_scale = 1.0  # calibration is a property of the drafter: it is forgotten slowly
        self._cache: tuple[int, list[float]] | None = None

    def tick(self) -> None:
        """One cycle passed: forget a little of everything."""
        self.scale *= self.decay
        self.bin_scale *= self.confidence_decay
        self.long_accepted *= LONG_DECAY
        self.long_reached *= LONG_DECAY
        self._renormalise()
        self._cache = None

    def forget(self, keep: float) -> None:
        """Keep only ``keep`` of the acceptance evidence (after a detected change, between requests)."""
        self.scale *= keep
        self._renormalise()
        self._cache = None

    def reset_to(self, rate: float, width: int, weight: float = 2.0) -> None:
        """Replace the acceptance evidence by ``weight`` cycles of the constant conditional
        ``rate`` at ``width`` drafts (after a detected change)."""
        width = max(1, width)
        a = min(max(rate, EPS), 1.0 - EPS)
        unit = weight / self.scale
        self.tried = [unit] * width
        self.survived = [unit * a ** (j + 1) for j in range(width)]
        self._cache = None

    def _renormalise(self) -> None:
        if self.scale < 1e-150:
            s = self.scale
            self.survived[:] = [v * s for v in self.survived]
            self.tried[:] = [v * s for v in self.tried]
            self.scale = 1.0
        if self.bin_scale < 1e-150:
            s = self.bin_scale
            for values in (self.bin_n, self.bin_x, self.bin_e):
                values[:] = [v * s for v in values]
            self.bin_scale = 1.0

    def survival(self, k: int) -> list[float]:
        """S_1..S_k from history alone."""
        out, previous = [], 1.0
        for a in self.position_rates(k):
            previous *= a
            out.append(previous)
        return out

    def position_rates(self, k: int) -> list[float]:
        """Conditional acceptance estimates a_1..a_k from history alone (cached per state)."""
        if self._cache is not None and self._cache[0] == k:
            return self._cache[1]
        s, m, prior = self.scale, self.weight, self.prior
        survived, tried = self.survived, self.tried
        n = min(len(tried), k)
        out = []
        previous = 1.0
        for j in range(n):
            current = (survived[j] * s + m * previous * prior) / (tried[j] * s + m)
            a = current / previous if current < previous else 1.0
            out.append(EPS if a < EPS else (1.0 - EPS if a > 1.0 - EPS else a))
            previous = previous * a if previous * a > 1e-12 else 1e-12
        out.extend([prior] * (k - n))
        self._cache = (k, out)
        return out

    def rates(self, k: int, confidence: Sequence[float | None] | None = None) -> list[float]:
        """a_1..a_k adjusted by this cycle's draft confidences (None entries are left alone)."""
        base = self.position_rates(k)
        if not confidence:
            return base
        out = []
        for j, a in enumerate(base):
            c = confidence[j] if j < len(confidence) else None
            shift = 0.0 if c is None else self._shift(self._bin(c))
            out.append(a if shift == 0.0 else min(max(sigmoid(logit(a) + shift), EPS), 1.0 - EPS))
        return out

    def _shift(self, b: int) -> float:
        s = self.bin_scale
        n = self.bin_n[b] * s
        if n <= 1e-9:
            return 0.0
        m = self.confidence_weight
        mean = self.bin_e[b] * s / n
        observed = (self.bin_x[b] * s + m * mean) / (n + m)
        predicted = (self.bin_e[b] * s + m * mean) / (n + m)
        return logit(observed) - logit(predicted)

    def observe(self, submitted: int, accepted: int, confidence: Sequence[float | None] | None = None) -> None:
        """A cycle submitted ``submitted`` drafts and the first ``accepted`` of them passed."""
        while len(self.tried) < submitted:
            self.tried.append(0.0)
            self.survived.append(0.0)
        unit, bin_unit = 1.0 / self.scale, 1.0 / self.bin_scale
        reached = min(accepted + 1, submitted)
        self.long_reached += reached
        self.long_accepted += min(accepted, reached)
        self.prior = (self.long_accepted + LONG_WEIGHT * self.initial_prior) / (self.long_reached + LONG_WEIGHT)
        predicted = self.position_rates(reached) if confidence else ()
        self._cache = None
        for j in range(submitted):
            self.tried[j] += unit
            if j < accepted:
                self.survived[j] += unit
            c = confidence[j] if confidence and j < reached and j < len(confidence) else None
            if c is not None:
                b = self._bin(c)
                self.bin_n[b] += bin_unit
                self.bin_x[b] += bin_unit if j < accepted else 0.0
                self.bin_e[b] += predicted[j] * bin_unit

    def _bin(self, confidence: float) -> int:
        if confidence > 1.0 and not self.scores:  # scores, not probabilities: rebin from scratch
            self.scores = True
            self.bin_n, self.bin_x, self.bin_e = [0.0] * BINS, [0.0] * BINS, [0.0] * BINS
        return min(int(squash(confidence, self.scores) * BINS), BINS - 1)

    def snapshot(self, k: int) -> list[float]:
        return [round(a, 4) for a in self.position_rates(k)]
