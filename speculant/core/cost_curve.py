"""A cost read off measured ``(x, y)`` points: the batch plan's curves of forward and draft
seconds (core/batch_plan.py)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def interpolated(points: Sequence[tuple[float, float]], x: float) -> float:
    """``y(x)`` read off measured ``(x, y)`` points (at least two distinct ``x``): see :func:`read`."""
    return read(*curve(points), x)


def curve(points: Sequence[tuple[float, float]]) -> tuple[list[float], np.ndarray]:
    """The distinct ``x`` of ``points`` in order and the median ``y`` at each, made non-decreasing."""
    xs = sorted({px for px, _ in points})
    ys = np.maximum.accumulate([float(np.median([py for px, py in points if px == at])) for at in xs])
    return xs, ys


def read(xs: list[float], ys: np.ndarray, x: float) -> float:
    """``y(x)`` on the curve: interpolated between its points, extended before them along the
    first segment (never below the first point's ``y`` per unit of ``x``) and past them along the
    line from the last point back to one at most half its ``x``; where none is that far back, in
    proportion to the last point (a slope read off nearby points is noise: 15 and 16 rows of one
    token each once priced 128 tokens like 16)."""
    if len(xs) < 2:
        return float(ys[0] * x / xs[0]) if xs[0] else float(ys[0])
    if x < xs[0]:
        slope = max(0.0, (ys[1] - ys[0]) / (xs[1] - xs[0]))
        return float(max(ys[0] - slope * (xs[0] - x), ys[0] * x / xs[0]))
    if x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    back = [i for i, at in enumerate(xs) if at <= xs[-1] / 2]
    slope = (ys[-1] - ys[back[-1]]) / (xs[-1] - xs[back[-1]]) if back else ys[-1] / xs[-1]
    return float(ys[-1] + max(slope, 0.0) * (x - xs[-1]))
