"""Snapshots of a PyTorch target's eager caches for the prefix store (core/prefix_cache.py).

A snapshot is a deep copy of the :class:`RollbackCache` as it stands after a crop (its buffers
trimmed, no block recorded): full-attention keys/values, sliding-window buffers and Gated
DeltaNet convolution and recurrent states alike. A restore copies it again, since a forward
updates some states in place. Only a cache whose every layer is full attention can be cut back to
a shorter prefix (the keys/values of the first ``length`` positions); the others are restored at
the length they were taken at.
"""

from __future__ import annotations

import copy

import torch

from speculant.backends.torch.rollback import RollbackCache
from speculant.core.prefix_cache import CacheSnapshot


def snapshot_cache(cache: RollbackCache, length: int) -> CacheSnapshot:
    state = copy.deepcopy(cache)
    return CacheSnapshot(state, length, cache_bytes(state), state._all_full_attention())


def restored_cache(snapshot: CacheSnapshot, length: int) -> RollbackCache:
    if length != snapshot.length and not snapshot.cuttable:
        raise ValueError(f"a snapshot of {snapshot.length} positions with sliding or recurrent layers "
                         f"cannot be restored at {length}")
    cache = copy.deepcopy(snapshot.state)
    if length < snapshot.length:
        cache.crop(length - snapshot.length)  # transformers' crop takes the positions to drop, negative
    return cache


def cache_bytes(cache: RollbackCache) -> int:
    """Bytes of every tensor the cache's layers hold (keys, values, states, in dicts too)."""
    total = 0
    for layer in cache.layers:
        for value in vars(layer).values():
            items = value.values() if isinstance(value, dict) else (value,)
            total += sum(item.nbytes for item in items if isinstance(item, torch.Tensor))
    return total
