"""Snapshots of a PyTorch target's caches for the prefix store (core/prefix_cache.py).

Eager path: a snapshot is a deep copy of the :class:`RollbackCache` as it stands after a crop
(its buffers trimmed, no block recorded): full-attention keys/values, sliding-window buffers and
Gated DeltaNet convolution and recurrent states alike. A restore copies it again, since a forward
updates some states in place. Only a cache whose every layer is full attention can be cut back to
a shorter prefix (the keys/values of the first ``length`` positions); the others are restored at
the length they were taken at.

Compiled path (:class:`StaticKV`, compiled.py): a snapshot copies every attention layer's first
``length`` rows (sliding layers are laid out whole there, row == position, so they are cut like
full ones) and every Gated DeltaNet layer's two states; a restore copies them back in place, as
the compiled graphs read the buffers at fixed addresses. Each path restores only its own snapshots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from speculant.backends.torch.compiled import StaticKV
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


@dataclass
class StaticState:
    """Per layer of a static cache: (keys, values) of its first rows, or a Gated DeltaNet layer's
    (convolution state, recurrent state)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]


@torch.inference_mode()
def snapshot_static(static: StaticKV) -> CacheSnapshot | None:
    n, layers = static.length, []
    for layer in static.cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            if not layer.has_previous_state[0]:
                return None
            layers.append((layer.conv_states[0].clone(), layer.recurrent_states[0].clone()))
        elif getattr(layer, "is_initialized", False):
            layers.append((layer.keys[:, :, :n].clone(), layer.values[:, :, :n].clone()))
        else:
            return None  # buffers not allocated yet
    nbytes = sum(a.nbytes + b.nbytes for a, b in layers)
    return CacheSnapshot(StaticState(layers), n, nbytes, cuttable=not static.hybrid)


@torch.inference_mode()
def restore_static(static: StaticKV, snapshot: CacheSnapshot, length: int) -> bool:
    """Copy ``snapshot`` into ``static``'s buffers in place; False when it is not a static one."""
    if not isinstance(snapshot.state, StaticState) or not static.fits(length):
        return False
    if length != snapshot.length and not snapshot.cuttable:
        raise ValueError(f"a snapshot of {snapshot.length} positions with Gated DeltaNet layers "
                         f"cannot be restored at {length}")
    for layer, (first, second) in zip(static.cache.layers, snapshot.state.layers, strict=True):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layer.conv_states[0].copy_(first)
            layer.recurrent_states[0].copy_(second)
            layer.has_previous_state[0] = True  # a restart() cleared it: the next forward reads the states
        else:
            layer.keys[:, :, :length].copy_(first[:, :, :length])
            layer.values[:, :, :length].copy_(second[:, :, :length])
    static.set_length(length)
    static.recorded = (length, 0)  # nothing before the restored length is ever undone
    return True
