"""A PyTorch batch row from and to the prefix store's snapshots (``prefix.py``'s eager format, a
``RollbackCache`` as the target leaves it), so a batched request resumes a stored prefix and
stores its own state when it ends (docs/prefix-cache.md, "Batched requests").

A batch keeps every attention layer at full length, one column per position (sliding layers are
masked to their window), while a snapshot's sliding layers hold only their last ``window - 1``
positions. A restored row therefore has zeros in a sliding layer's columns before those; they are
never read, since every later query is at least ``window`` positions past them. The other way, a
row's sliding columns are cut back to the window by the snapshot cache's own crop. Gated DeltaNet
layers move as they are, one row of their convolution and recurrent states.

Both of the target's formats: the eager ``RollbackCache``, and the compiled path's
``StaticState`` (every attention layer's first rows, sliding ones laid out whole, and each Gated
DeltaNet layer's two states). A row stored for the compiled path is cut at any token only where
every layer is full attention: a restored row's window layers have zeros before the window.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from speculant.backends.torch.growing import GrowingLayer
from speculant.backends.torch.prefix import StaticState, cache_bytes
from speculant.backends.torch.rollback import RollbackCache
from speculant.core.prefix_cache import CacheSnapshot


def restorable(snapshot: CacheSnapshot) -> bool:
    return isinstance(snapshot.state, (RollbackCache, StaticState))


def restored(batch, snapshot: CacheSnapshot, length: int):
    """A one-row cache in ``batch``'s layout holding ``snapshot``'s first ``length`` positions."""
    solo, static = batch._new_cache(), isinstance(snapshot.state, StaticState)
    saved = snapshot.state.layers
    if not isinstance(solo, RollbackCache):  # a dense batch's DynamicCache grows its layers lazily
        solo.layers = [GrowingLayer() for _ in saved]
    for index, layer in enumerate(saved):
        if isinstance(solo.layers[index], LinearAttentionCacheLayerMixin):
            solo.layers[index] = _linear_states(solo.layers[index], *layer, length) if static else copy.deepcopy(layer)
            continue
        keys, values = layer if static else (layer.keys, layer.values)  # a static layer's from position 0
        solo.layers[index].update(_placed(keys, snapshot.length, length), _placed(values, snapshot.length, length))
    return solo


def snapshot(batch, row: int) -> CacheSnapshot:
    """Row ``row`` of ``batch`` as the target's own snapshot of one sequence would hold it."""
    from speculant.backends.torch.batch import _attention_layers, _linear_layers  # it imports this module

    target = batch.target
    columns = torch.from_numpy(batch.book.held(row)).to(batch._device)
    steps = target._steps
    if steps is not None and steps.failure is None:  # the target's requests run on its static cache
        return _static_snapshot(batch, row, columns)
    cache = target._cache_cls(config=target.model.config)
    attention, linear = iter(_attention_layers(batch.cache)), iter(_linear_layers(batch.cache))
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            cache.layers[index] = _linear_row(next(linear), row, len(columns))
        else:
            source = next(attention)
            layer.update(source.keys[row:row + 1, :, columns], source.values[row:row + 1, :, columns])
    cache.rollback(0)  # trims the sliding layers to their window, as the target's crop does
    return CacheSnapshot(cache, len(columns), cache_bytes(cache), cache._all_full_attention())


def _static_snapshot(batch, row: int, columns: torch.Tensor) -> CacheSnapshot:
    layers = []
    for layer in batch.cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            layers.append((layer.conv_states[0][row:row + 1].clone(), layer.recurrent_states[0][row:row + 1].clone()))
        else:
            layers.append((layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns]))
    full = not batch._hybrid and all(window is None for window in batch._windows.values())
    nbytes = sum(a.nbytes + b.nbytes for a, b in layers)
    return CacheSnapshot(StaticState(layers), len(columns), nbytes, cuttable=full)


def _placed(tensor: torch.Tensor, end: int, length: int) -> torch.Tensor:
    """Positions ``0 .. length - 1`` from ``tensor`` ``[1, heads, held, dim]``, which holds the
    last ``held`` positions before ``end``; zeros for those it lacks (before a sliding window)."""
    first = end - int(tensor.shape[2])
    kept = tensor[:, :, : length - first]
    if first == 0:
        return kept
    return torch.cat([kept.new_zeros((*kept.shape[:2], first, kept.shape[3])), kept], dim=2)


def _linear_states(layer, conv: torch.Tensor, recurrent: torch.Tensor, length: int):
    """``layer`` (an empty Gated DeltaNet layer) given a static snapshot's states after ``length`` positions."""
    layer.dtype, layer.device = conv.dtype, conv.device
    layer.conv_kernel_size[0] = int(conv.shape[-1])
    layer.conv_states[0], layer.recurrent_states[0] = conv.clone(), recurrent.clone()
    layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
    layer.has_previous_state[0] = True
    layer.cumulative_length_linear = torch.tensor(length, dtype=layer.cumulative_length_linear.dtype)
    return layer


def _linear_row(layer, row: int, length: int):
    """A Gated DeltaNet layer holding row ``row`` of ``layer``'s states after ``length`` positions."""
    one = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, dict):
            setattr(one, name, {k: list(v) if isinstance(v, list) else v for k, v in value.items()})
    for state in (one.conv_states, one.recurrent_states):
        for index, tensor in state.items():
            if tensor is not None:
                state[index] = tensor[row:row + 1].clone()
    one.cumulative_length_linear = torch.tensor(length, dtype=layer.cumulative_length_linear.dtype)
    return one
