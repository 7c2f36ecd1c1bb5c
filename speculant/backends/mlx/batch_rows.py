"""An MLX batch row from and to the prefix store's snapshots (``prefix.py``'s eager format: the
target's list of ``KVCache`` / ``WindowKVCache`` / ``DeltaCache``), so a batched request resumes a
stored prefix and stores its own state when it ends (docs/prefix-cache.md, "Batched requests").

The layout question is PyTorch's (``backends/torch/batch_rows.py``): a batch keeps every
attention layer at full length, one column per position, while a snapshot's window layers hold
only their last positions, so a restored row has zeros in a window layer's columns before those,
which no later query reads; the other way, a row's window columns are cut to ``window - 1``.
Gated DeltaNet layers move as they are, one row of their two states.

Both of the target's formats: the eager caches, and the compiled path's ``StaticKVCache``
buffers (``static.py``: a full layer's row ``p`` is position ``p``, a window layer's ring holds
position ``p`` at row ``p % capacity``). A row stored for the compiled path lays its window layers
out whole (rows are positions, zeros before the window), which a restore reads like a ring that
never wrapped; such a snapshot is never cut (it has window layers), so the zeros stay unread.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from speculant.backends.mlx.caches import DeltaCache, WindowKVCache, target_cache
from speculant.backends.mlx.prefix import snapshot_caches
from speculant.backends.mlx.static import StaticKVCache
from speculant.core.buffers import capacity_for
from speculant.core.prefix_cache import CacheSnapshot

_KINDS = (KVCache, WindowKVCache, DeltaCache, StaticKVCache)


def restorable(snapshot: CacheSnapshot) -> bool:
    """Whether ``snapshot`` is an MLX target's (eager or compiled)."""
    return isinstance(snapshot.state, list) and all(type(c) in _KINDS for c in snapshot.state)


def restored(batch, snapshot: CacheSnapshot, length: int) -> list:
    """One row's layers in ``batch``'s layout holding ``snapshot``'s first ``length`` positions."""
    solo = batch._new_layers()
    for layer, saved in zip(solo, snapshot.state, strict=True):
        if isinstance(layer, DeltaCache):
            layer.cache = list(saved.cache)
        else:
            keys, values = _held(saved, snapshot.length)
            layer.keys, layer.values = _placed(keys, snapshot.length, length), _placed(values, snapshot.length, length)
    return solo


def snapshot(batch, row: int) -> CacheSnapshot:
    """Row ``row`` of ``batch`` as the target's own snapshot of one sequence would hold it."""
    from speculant.backends.mlx.batch import _attention, _deltas  # it imports this module

    target = batch.target
    compiled = target._static is not None
    caches = [_layer(c) for c in target.cache] if compiled else target_cache(target.model, target.info.sliding_window)
    held = batch.book.held(row)
    columns, length = mx.array(held), len(held)
    attention, deltas = iter(_attention(batch.layers)), iter(_deltas(batch.layers))
    for cache in caches:
        if isinstance(cache, DeltaCache):
            source = next(deltas)
            cache.cache = [source[0][row:row + 1], source[1][row:row + 1]]
            continue
        source = next(attention)
        keys = mx.take(source.keys[row:row + 1], columns, axis=2)
        values = mx.take(source.values[row:row + 1], columns, axis=2)
        if isinstance(cache, StaticKVCache):  # rows are positions
            rows = capacity_for(length)
            pad = [(0, 0), (0, 0), (0, rows - length), (0, 0)]
            cache.keys, cache.values = mx.pad(keys, pad), mx.pad(values, pad)
            cache.capacity, cache.written = rows, length
            continue
        if isinstance(cache, WindowKVCache):  # only the positions the next query can see
            kept = min(length, cache.window - 1)
            cache.offset = cache.start = length - kept
            keys, values = keys[:, :, length - kept:], values[:, :, length - kept:]
        cache.update_and_fetch(keys, values)
    return snapshot_caches(caches, length)


def _layer(live):
    """An empty layer cache of the kind ``live`` (a compiled target's) is."""
    return DeltaCache(len(live.cache)) if isinstance(live, DeltaCache) else StaticKVCache(live.window)


def _held(saved, end: int) -> tuple[mx.array, mx.array]:
    """The keys and values a stored layer holds, the last positions before ``end`` in order."""
    if isinstance(saved, StaticKVCache):
        if saved.window is None:
            return saved.keys[:, :, :end], saved.values[:, :, :end]
        rows = mx.arange(max(0, end - saved.window + 1), end) % saved.capacity  # the ring's window
        return mx.take(saved.keys, rows, axis=2), mx.take(saved.values, rows, axis=2)
    first = saved.start if isinstance(saved, WindowKVCache) else 0  # the buffer's first position
    used = saved.offset - first
    return saved.keys[:, :, :used], saved.values[:, :, :used]


def _placed(array: mx.array, end: int, length: int) -> mx.array:
    """Positions ``0 .. length - 1`` from ``array`` ``[1, heads, held, dim]``, which holds the last
    ``held`` positions before ``end``; zeros for those it lacks (before a window)."""
    first = end - int(array.shape[2])
    kept = array[:, :, : length - first]
    return kept if first == 0 else mx.pad(kept, [(0, 0), (0, 0), (first, 0), (0, 0)])
