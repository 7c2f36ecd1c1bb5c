"""The adaptive verifier's cost model: what a cycle costs on this machine, measured online.

Target forward time is kept per verify width (rows in the forward: anchor + submitted drafts)
and per context bucket (half-octaves of the context length from 256 on), because long
contexts make every forward slower and can change the shape of the cost curve. A width not
yet measured in the current bucket is borrowed from the nearest bucket that has it, scaled by
a width both buckets measured. Measured widths keep their own values (cost curves need not be
monotone); a width never measured costs what a non-decreasing fit over the measured ones
(isotonic regression weighted by sample counts) gives the nearest narrower measured width. Draft time (``Drafter.propose``) and the per-cycle rest
(drafter commit + verification) are single running averages.

Samples update running means (plain averages for the first few, then exponentially weighted),
clipped to a factor of three around the current mean so one descheduling spike on a shared
machine cannot wreck an entry. A fixed relative cost table can replace the measurements
(``cost_table``), for hand-profiled machines and for tests.
"""

from __future__ import annotations

import math
from typing import Sequence

SPIKE_FACTOR = 3.0
WEIGHT_CAP = 16.0  # a width's weight (in samples) stops growing here
REFIT_EVERY = 4  # samples between re-estimations (estimates move slowly; the policy runs every cycle)


def context_bucket(context_length: int) -> int:
    """0 below 256 tokens, then one bucket per half-octave (256, 362, 512, 724, 1024, ...)."""
    if context_length < 256:
        return 0
    return 1 + int(2.0 * math.log2(context_length / 256.0))


class RunningMean:
    """A robust running mean of timing samples.

    Delays on a busy machine only ever add time. Until ``TRUSTED`` samples exist, ``value`` is
    the smallest one (an early spike must not make a width look expensive; a lucky low sample
    is corrected as soon as the width is used); then the mean starts at their median and
    follows later samples exponentially, each clipped to a factor of ``SPIKE_FACTOR``.
    """

    __slots__ = ("mean", "count", "first")
    TRUSTED = 3

    def __init__(self) -> None:
        self.mean = 0.0
        self.count = 0
        self.first: list[float] = []

    def add(self, value: float, alpha: float) -> None:
        self.count += 1
        if self.count <= self.TRUSTED:
            self.first.append(value)
            self.mean = sorted(self.first)[(len(self.first) - 1) // 2]
            return
        value = min(max(value, self.mean / SPIKE_FACTOR), self.mean * SPIKE_FACTOR)
        self.mean += (value - self.mean) * alpha

    @property
    def value(self) -> float:
        return min(self.first) if self.count < self.TRUSTED else self.mean


class CostModel:
    """Seconds per target forward of each width, per draft call and per cycle overhead."""

    def __init__(self, alpha: float = 0.2, table: Sequence[float] | None = None, draft_cost: float | None = None) -> None:
        self.alpha = alpha
        self.table = list(table) if table else None
        self.fixed_draft = draft_cost
        self.buckets: dict[int, dict[int, RunningMean]] = {}
        self.draft = RunningMean()
        self.rest = RunningMean()
        self._version = 0  # samples taken
        self._widths = 0  # entries created
        self._cache: tuple | None = None

    # -- measurements ------------------------------------------------------------------------
    def add_target(self, width: int, context_length: int, seconds: float) -> None:
        if self.table is not None or seconds <= 0.0:
            return
        entries = self.buckets.setdefault(context_bucket(context_length), {})
        if width not in entries:
            entries[width] = RunningMean()
            self._widths += 1  # a new entry changes the estimates at once
        entries[width].add(seconds, self.alpha)
        self._version += 1

    def add_draft(self, seconds: float) -> None:
        if seconds > 0.0:
            self.draft.add(seconds, self.alpha)

    def add_rest(self, seconds: float) -> None:
        if seconds > 0.0:
            self.rest.add(seconds, self.alpha)

    # -- estimates ---------------------------------------------------------------------------
    def measured(self, width: int, context_length: int) -> int:
        """How many samples of this width the current context bucket holds."""
        entry = self.buckets.get(context_bucket(context_length), {}).get(width)
        return entry.count if entry is not None else 0

    def draft_s(self) -> float:
        if self.fixed_draft is not None:
            return self.fixed_draft
        return self.draft.mean

    def rest_s(self) -> float:
        return 0.0 if self.table is not None else self.rest.mean

    def target_s(self, max_width: int, context_length: int) -> list[float]:
        """Estimated seconds of a forward of width 1..max_width (index 0 = width 1)."""
        if self.table is not None:
            t = self.table
            return [t[min(w, len(t)) - 1] for w in range(1, max_width + 1)]
        key = (max_width, context_bucket(context_length), self._widths)
        if self._cache is None or self._cache[0] != key or self._version - self._cache[1] >= REFIT_EVERY:
            self._cache = (key, self._version, self._estimate(max_width, key[1]))
        return self._cache[2]

    def _estimate(self, max_width: int, bucket: int) -> list[float]:
        """Each measured width at its own running mean; an unmeasured width at what a
        non-decreasing fit over the measured ones gives the nearest narrower measured width.

        Real cost curves need not be monotone (BLAS kernels change with the row count, so a
        forward of 15 rows can cost less than one of 14), so measured widths keep their own
        values. For widths never measured the fit (weighted isotonic regression, pooling
        adjacent violators) is the optimistic guess: the policy tries such a width when it
        might pay, and then it is measured.
        """
        points = self._points(bucket)
        if not points:
            return [1.0] * max_width  # nothing measured yet: every width looks the same
        widths = sorted(points)
        fitted = dict(zip(widths, isotonic([points[w][0] for w in widths], [points[w][1] for w in widths])))
        out = []
        lower = fitted[widths[0]]
        for w in range(1, max_width + 1):
            if w in points:
                lower = fitted[w]
                out.append(points[w][0])
            else:
                out.append(lower)
        return out

    def _points(self, bucket: int) -> dict[int, tuple[float, float]]:
        """(mean, weight) per width for ``bucket``: its own entries, else borrowed from the
        nearest bucket that measured the width, scaled by a width both measured, at half weight."""
        here = self.buckets.get(bucket, {})
        points = {w: (e.value, min(float(e.count), WEIGHT_CAP)) for w, e in here.items()}
        for b in sorted(self.buckets, key=lambda b: (abs(b - bucket), b)):
            if b == bucket:
                continue
            there = self.buckets[b]
            missing = [w for w in there if w not in points]
            if not missing:
                continue
            shared = [w for w in here if w in there]
            scale = 1.0
            if shared:
                ref = max(shared, key=lambda w: here[w].count)
                scale = here[ref].value / there[ref].value
            for w in missing:
                points[w] = (there[w].value * scale, 0.5 * min(float(there[w].count), WEIGHT_CAP))
        return points

    def snapshot(self, max_width: int, context_length: int) -> dict:
        """Current estimates (milliseconds, or the unit of a fixed ``cost_table``), for the stats."""
        scale, unit = (1.0, "table") if self.table is not None else (1e3, "ms")
        return {
            "unit": unit,
            "target": [round(t * scale, 4) for t in self.target_s(max_width, context_length)],
            "draft": round(self.draft_s() * scale, 4),
            "rest": round(self.rest_s() * scale, 4),
            "context_bucket": context_bucket(context_length),
        }


def isotonic(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights):
        blocks.append([v, max(w, 1e-9), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for mean, _, length in blocks:
        out.extend([mean] * int(length))
    return out
