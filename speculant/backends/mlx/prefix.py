"""Snapshots of an MLX target's caches for the prefix store (core/prefix_cache.py).

A snapshot is a deep copy of every layer's cache object as it stands after a crop: mlx-lm's
``KVCache``, ``WindowKVCache`` and ``DeltaCache`` on the eager path, the compiled path's
``StaticKVCache`` buffers and ``DeltaCache`` states alike (copies: a ring's rows are written in
place). A restore copies the saved attributes into the live cache objects, which the compiled
forward holds on to. Only full-attention layers can be cut back to a shorter prefix (their
``trim`` moves the write position back, as a rollback does).
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from speculant.backends.mlx.static import StaticKVCache
from speculant.core.buffers import capacity_for
from speculant.core.prefix_cache import CacheSnapshot


def snapshot_caches(caches: list, length: int) -> CacheSnapshot:
    saved = copy.deepcopy(caches)
    for c in saved:
        if type(c) is StaticKVCache:  # the last compiled call's input, set again before every forward
            c.offset = mx.array(0, dtype=mx.int32)
            _fit(c, length)
    arrays = [a for c in saved for a in _arrays(c)]
    mx.eval(arrays)
    return CacheSnapshot(saved, length, sum(a.nbytes for a in arrays), all(_full_attention(c) for c in saved))


def restore_caches(caches: list, snapshot: CacheSnapshot, length: int) -> None:
    if length != snapshot.length and not snapshot.cuttable:
        raise ValueError(f"a snapshot of {snapshot.length} positions with sliding or recurrent layers "
                         f"cannot be restored at {length}")
    for live, saved in zip(caches, copy.deepcopy(snapshot.state), strict=True):
        if type(live) is not type(saved):
            raise TypeError(f"a {type(saved).__name__} snapshot cannot be restored into a {type(live).__name__}")
        vars(live).update(vars(saved))
        if length < snapshot.length:
            live.trim(snapshot.length - length)
            if type(live) is StaticKVCache:
                _fit(live, length)


def _fit(cache: StaticKVCache, length: int) -> None:
    """A full-attention layer's buffers cut to the rows ``length`` positions need (a short request
    after a long one starts with small buffers, as after a reset); a ring is kept as it is."""
    size = capacity_for(length)
    if cache.window is None and cache.keys is not None and cache.capacity > size:
        cache.keys, cache.values = cache.keys[:, :, :size], cache.values[:, :, :size]
        cache.capacity, cache.written = size, min(cache.written, length)


def _full_attention(cache) -> bool:
    return type(cache) is KVCache or (type(cache) is StaticKVCache and cache.window is None)


def _arrays(cache) -> list:
    """Every array a layer's cache holds (in lists too)."""
    found = []
    for value in vars(cache).values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, mx.array):
                found.append(item)
    return found
