"""A sequence moving between the target's own cache and a batch row (core/scheduler.py): its
caches copied as they stand, rebuilt by a prefill of its context only where the other side
cannot take the copy. A move costs a copy of the caches, so a long context that runs alone does
not stall the batch it moves into by a prefill of every token it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

from speculant.core.metrics import GenerationStats
from speculant.core.types import Capture

if TYPE_CHECKING:
    from speculant.core.batch import BatchedTarget
    from speculant.core.interfaces import TargetModel
    from speculant.core.prefix_cache import CacheSnapshot


def into_batch(target: "TargetModel", rows: "BatchedTarget", key: Hashable, context: Sequence[int],
               capture: Capture, stats: GenerationStats) -> None:
    """Add row ``key`` to ``rows`` holding ``context``, from the target's cache where that holds
    exactly it, else prefilled (counted in ``stats``)."""
    snapshot = target.snapshot() if target.cache_length == len(context) else None
    if snapshot is not None and rows.join_snapshot(key, snapshot):
        stats.cache_moves += 1
        return
    rows.join(key, context, capture)
    stats.cache_rebuilds += 1


def out_of_batch(target: "TargetModel", snapshot: "CacheSnapshot | None", context: Sequence[int],
                 stats: GenerationStats) -> None:
    """The target's own cache holding ``context``: restored from its row's ``snapshot`` (taken
    before the row left), else prefilled (counted in ``stats``)."""
    target.reset()
    if snapshot is not None and snapshot.length == len(context) and target.restore(snapshot, len(context)):
        stats.cache_moves += 1
        return
    target.reset()
    target.prefill(context)
    stats.cache_rebuilds += 1
