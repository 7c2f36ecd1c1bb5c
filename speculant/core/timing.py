"""Whether another layout of a model's weights is faster on this machine, measured at load.

The CPU fast paths that only change how weights are laid out (packed for oneDNN on PyTorch,
stored transposed on MLX) pay on some CPUs and lose on others: packing took 25 % off a verify
block on a 2-core AMD EPYC, and ran at 0.74-0.94 of dense speed on an Intel Xeon with AVX-512
(docs/fast-path.md).
So ``backend.compile: auto`` times both layouts on the model's own layer shapes, interleaved,
and keeps the new one only where it is faster by ``MARGIN``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Hashable, Sequence

MARGIN = 1.05  # the new layout must be this much faster than the old one to be kept
REPEATS = 7


def speedup(cases: Sequence[tuple[int, Callable[[], None], Callable[[], None]]], repeats: int = REPEATS) -> float:
    """The old layout's time over the new one's, for ``(weight, new, old)`` cases: each case's
    median over interleaved repeats, summed with its weight (how many layers share its shape).
    Each callable must return only once its work is done."""
    new_total = old_total = 0.0
    for weight, new, old in cases:
        new()  # first calls allocate and warm caches
        old()
        new_times, old_times = [], []
        for _ in range(repeats):
            old_times.append(_seconds(old))
            new_times.append(_seconds(new))
        new_total += weight * statistics.median(new_times)
        old_total += weight * statistics.median(old_times)
    return old_total / new_total if new_total > 0 else float("inf")


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def speedup_by_shape(layers: Sequence[Any], shape: Callable[[Any], Hashable],
                     case: Callable[[Any], tuple[Callable[[], None], Callable[[], None]]]) -> float:
    """:func:`speedup` over one layer of each ``shape(layer)``, weighted by how many layers share it;
    ``case(layer)`` gives that layer's (new layout, old layout) callables."""
    groups: dict[Hashable, list] = {}
    for layer in layers:
        groups.setdefault(shape(layer), [0, layer])[0] += 1
    return speedup([(count, *case(layer)) for count, layer in groups.values()])
