"""The adaptive verifier's cost model: what a cycle costs on this machine, measured online.

Target forward time is kept per verify width (rows in the forward: anchor + submitted drafts)
and per context bucket (half-octaves of the context length from 256 on), because long
contexts make every forward slower and can change the shape of the cost curve. A width's
entry in the current bucket is pooled with the most precise entry of another bucket, scaled by
a width both buckets measured. Each width's mean is pulled towards a straight line over all
widths as far as its own noise requires (clean timings keep steps and dips, noisy ones lean
on the line); a width never measured costs the line. Draft time (``Drafter.propose``) is kept
per draft length, since a block drafter's forward grows with its rows (a length not yet measured
costs a line through those that were); the per-cycle rest (drafter commit + verification) is one
running average.

Samples update robust running means: the median of the first three, then exponentially
weighted, each sample clipped to a factor of three around the mean. On a shared machine
everything slows down and speeds up together as other processes come and go; a width
measured while the machine was busy would look expensive next to one measured while it was
idle, and the policy would chase the load. So a common ``load`` factor is tracked (how much
slower each target forward is than its width's estimate, exponentially weighted in log
space) and every sample is stored divided by it: estimates are relative costs in one unit,
and decisions depend only on their ratios, which the load does not change. A fixed relative
cost table can replace the measurements (``cost_table``), for hand-profiled machines and tests.
"""

from __future__ import annotations

import math
from typing import Sequence

SPIKE_FACTOR = 3.0
LOAD_ALPHA = 0.3  # how fast the common slow-down of all timings (other processes' load) is tracked
DEVIATION = 0.05  # prior spread of a width's true cost around the line (relative)
REFIT_EVERY = 4  # samples between re-estimations (estimates move slowly; the policy runs every cycle)


def context_bucket(context_length: int) -> int:
    """0 below 256 tokens, then one bucket per half-octave (256, 362, 512, 724, 1024, ...)."""
    if context_length < 256:
        return 0
    return 1 + int(2.0 * math.log2(context_length / 256.0))


class RunningMean:
    """A robust running mean and variance of timing samples.

    The mean starts at the median of the first ``TRUSTED`` samples and the variance at their
    median absolute deviation (one early spike sets neither), then both follow later samples
    exponentially, each sample clipped to a factor of ``SPIKE_FACTOR`` around the mean.
    """

    __slots__ = ("mean", "var", "count", "first")
    TRUSTED = 3

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self.first: list[float] = []

    def add(self, value: float, alpha: float) -> None:
        self.count += 1
        if self.count <= self.TRUSTED:
            self.first.append(value)
            self.mean = _median(self.first)
            self.var = (1.4826 * _median([abs(v - self.mean) for v in self.first])) ** 2  # robust (MAD)
            return
        value = min(max(value, self.mean / SPIKE_FACTOR), self.mean * SPIKE_FACTOR)
        delta = value - self.mean
        self.mean += alpha * delta
        self.var = (1 - alpha) * (self.var + alpha * delta * delta)

    def mean_variance(self, alpha: float) -> float:
        """Variance of ``mean`` as an estimate (sample variance over the effective sample count),
        never below that of an assumed 5 % noise; large until ``TRUSTED`` samples exist."""
        if self.count < self.TRUSTED:
            return (0.5 * self.mean) ** 2
        effective = min(float(self.count), (2.0 - alpha) / alpha)
        return max(self.var, (0.05 * self.mean) ** 2) / effective


def _rising_line(points: dict[int, tuple[float, float]]) -> tuple[float, float, float]:
    """(x mean, y mean, slope) of the weighted least-squares line through ``points`` (x -> (y,
    weight)), its slope never negative: costs do not fall as rows are added."""
    total = sum(q for _, q in points.values())
    x_bar = sum(x * q for x, (_, q) in points.items()) / total
    y_bar = sum(y * q for y, q in points.values()) / total
    spread = sum(q * (x - x_bar) ** 2 for x, (_, q) in points.items())
    slope = max(0.0, sum(q * (x - x_bar) * (y - y_bar) for x, (y, q) in points.items()) / spread) if spread > 0 else 0.0
    return x_bar, y_bar, slope


def _draft_line(known: dict[int, RunningMean], length: int) -> float:
    """The count-weighted rising line of draft seconds over draft lengths (flat through the mean
    with one length), at ``length``."""
    k_bar, d_bar, slope = _rising_line({k: (e.mean, float(min(e.count, 16))) for k, e in known.items()})
    return max(d_bar + slope * (length - k_bar), 0.5 * min(e.mean for e in known.values()))


def _median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


class CostModel:
    """Seconds per target forward of each width, per draft call and per cycle overhead."""

    def __init__(self, alpha: float = 0.2, table: Sequence[float] | None = None, draft_cost: float | None = None) -> None:
        self.alpha = alpha
        self.table = list(table) if table else None
        self.fixed_draft = draft_cost
        self.buckets: dict[int, dict[int, RunningMean]] = {}
        self.drafts: dict[int, RunningMean] = {}  # per draft length (tokens proposed)
        self.rest = RunningMean()
        self.load = 1.0  # how much slower the machine runs now than in the estimates' unit
        self._version = 0  # samples taken
        self._widths = 0  # entries created
        self._cache: tuple | None = None

    # -- measurements ------------------------------------------------------------------------
    def add_target(self, width: int, context_length: int, seconds: float) -> None:
        if self.table is not None or seconds <= 0.0:
            return
        entries = self.buckets.setdefault(context_bucket(context_length), {})
        entry = entries.get(width)
        if entry is None:
            entry = entries[width] = RunningMean()
            self._widths += 1  # a new entry changes the estimates at once
        elif entry.count >= RunningMean.TRUSTED:  # how much slower than expected is everything now?
            ratio = min(max(seconds / (entry.mean * self.load), 1.0 / SPIKE_FACTOR), SPIKE_FACTOR)
            self.load *= ratio ** LOAD_ALPHA
        entry.add(seconds / self.load, self.alpha)
        self._version += 1

    def add_draft(self, seconds: float, backlog: bool = False, length: int = 0) -> None:
        """A draft call's seconds, for ``length`` proposed tokens; ``backlog``: the call first read
        many target rows (the prompt, or those of a run of plain steps), so it is only an upper
        bound of a steady call's and may lower the estimate, never raise it (once a few calls are
        known)."""
        if seconds <= 0.0:
            return
        value = seconds / self.load
        entry = self.drafts.setdefault(length, RunningMean())
        if backlog and entry.count >= RunningMean.TRUSTED and value >= entry.mean:
            return
        entry.add(value, self.alpha)

    def add_rest(self, seconds: float) -> None:
        if seconds > 0.0:
            self.rest.add(seconds / self.load, self.alpha)

    # -- estimates ---------------------------------------------------------------------------
    def measured(self, width: int, context_length: int) -> int:
        """How many samples of this width the current context bucket holds."""
        entry = self.buckets.get(context_bucket(context_length), {}).get(width)
        return entry.count if entry is not None else 0

    def draft_s(self, length: int | None = None) -> float:
        """Seconds of a draft of ``length`` tokens (None: the longest measured): its own mean once
        trusted, else a line through the measured lengths (flat while only one was measured)."""
        if self.fixed_draft is not None:
            return self.fixed_draft
        known = {k: e for k, e in self.drafts.items() if e.count}
        if not known:
            return 0.0
        length = max(known) if length is None else length
        entry = known.get(length)
        if entry is not None and (entry.count >= RunningMean.TRUSTED or len(known) == 1):
            return entry.mean
        return _draft_line(known, length)

    def rest_s(self) -> float:
        return 0.0 if self.table is not None else self.rest.mean

    def target_s(self, max_width: int, context_length: int, optimistic: bool = False) -> list[float]:
        """Estimated seconds of a forward of width 1..max_width (index 0 = width 1); with
        ``optimistic``, lower confidence bounds (two standard errors below) for exploring."""
        if self.table is not None:
            t = self.table
            return [t[min(w, len(t)) - 1] for w in range(1, max_width + 1)]
        key = (max_width, context_bucket(context_length), self._widths)
        if self._cache is None or self._cache[0] != key or self._version - self._cache[1] >= REFIT_EVERY:
            self._cache = (key, self._version, *self._estimate(max_width, key[1]))
        return self._cache[3] if optimistic else self._cache[2]

    def _estimate(self, max_width: int, bucket: int) -> tuple[list[float], list[float]]:
        """Per-width means pulled towards a line over all widths as far as their noise requires.

        Real cost curves have steps and dips (kernels change with the row count, graphs pad to
        captured sizes), but on a busy machine wall-clock samples are noisy and raw means would
        favour whichever width had lucky samples, and invent steps between widths measured at
        different times. So each width's estimate is the empirical-Bayes blend
        ``fit + lam * (mean - fit)``, ``lam = tau^2 / (tau^2 + var(mean))``, ``tau`` =
        ``DEVIATION`` of the fit, where the fit is a precision-weighted straight line in the
        width (never decreasing): clean timings keep their own steps and dips, noisy ones lean
        on the line. A width never measured costs the line. Also returns lower confidence
        bounds (two standard errors below; ``2 * DEVIATION`` below the line when unmeasured) for
        exploring.
        """
        points = self._points(bucket)
        if not points:
            return [1.0] * max_width, [1.0] * max_width  # nothing measured yet: all widths alike
        w_bar, t_bar, slope = _rising_line({w: (mean, 1.0 / max(var, 1e-30)) for w, (mean, var) in points.items()})
        floor = 0.5 * min(m for m, _ in points.values())
        out, low = [], []
        for w in range(1, max_width + 1):
            fit = max(t_bar + slope * (w - w_bar), floor)
            tau2 = (DEVIATION * fit) ** 2
            if w in points:
                mean, var = points[w]
                blend = tau2 / (tau2 + var)
                out.append(fit + blend * (mean - fit))
                low.append(max(out[-1] - 2.0 * math.sqrt(blend * var), 0.5 * out[-1]))
            else:
                out.append(fit)
                low.append(fit * (1.0 - 2.0 * DEVIATION))
        return out, low

    def _points(self, bucket: int) -> dict[int, tuple[float, float]]:
        """(mean, variance of the mean) per width for ``bucket``: its own entry pooled (by
        precision) with the most precise entry of another bucket, scaled by a width both
        buckets measured, its variance doubled per bucket of distance."""
        alpha = self.alpha
        here = self.buckets.get(bucket, {})
        borrowed: dict[int, tuple[float, float]] = {}
        for b, there in self.buckets.items():
            if b == bucket:
                continue
            shared = [w for w in here if w in there]
            scale = 1.0
            if shared:
                ref = max(shared, key=lambda w: min(here[w].count, there[w].count))
                scale = here[ref].mean / there[ref].mean
            penalty = 2.0 ** abs(b - bucket) * scale * scale
            for w, e in there.items():
                candidate = (e.mean * scale, e.mean_variance(alpha) * penalty)
                if w not in borrowed or candidate[1] < borrowed[w][1]:
                    borrowed[w] = candidate
        points = {}
        for w in set(here) | set(borrowed):
            own = (here[w].mean, here[w].mean_variance(alpha)) if w in here else None
            other = borrowed.get(w)
            if own is None or other is None:
                points[w] = own or other
                continue
            p1, p2 = 1.0 / max(own[1], 1e-30), 1.0 / max(other[1], 1e-30)
            points[w] = ((own[0] * p1 + other[0] * p2) / (p1 + p2), 1.0 / (p1 + p2))
        return points

    def snapshot(self, max_width: int, context_length: int) -> dict:
        """Current estimates (milliseconds, or the unit of a fixed ``cost_table``), for the stats."""
        scale, unit = (1.0, "table") if self.table is not None else (1e3, "ms")
        return {
            "unit": unit,
            "target": [round(t * scale, 4) for t in self.target_s(max_width, context_length)],
            "draft": round(self.draft_s() * scale, 4),  # the longest draft measured
            "draft_by_length": {k: round(self.draft_s(k) * scale, 4) for k in sorted(self.drafts)},
            "rest": round(self.rest_s() * scale, 4),
            "context_bucket": context_bucket(context_length),
            "load": round(self.load, 4),
        }
