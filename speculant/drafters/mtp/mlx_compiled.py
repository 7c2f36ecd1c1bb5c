"""The MTP step on MLX under ``mx.compile``, used where the target's whole forward runs compiled
(``speculant/backends/mlx/static.py``).

The eager :class:`~speculant.drafters.mtp.mlx_cache.LayerCache` slices its buffers at Python ints and
builds its mask on the host, which a trace would bake in. Here each MTP layer keeps buffers
whose row is the position (keys, values, and each row's position, ``FAR`` until written), passed
through the compiled function as arrays:

- A step writes its rows at their positions and attends over every row holding a position at
  or before each query's. A layer does not hold every position: a chained layer's draft step
  can skip one (layer 0 drafts at ``b + 2`` of a 2-layer chain, leaving ``b + 1`` to layer 1). So
  a crop that drops entries marks every row after the last kept position unwritten, and a row
  an earlier request or a dropped draft left there cannot be seen.
- Rows are padded to a power of two (a draft step is one row; a commit 1 .. block rows), so a
  layer traces once per (bucket, buffer rows). The padding rows lie after the real ones and are
  marked unwritten. Buffers grow as ``speculant.core.buffers.capacity_for`` says. More rows than
  ``COMPILED_ROWS`` (a prompt) run the same function uncompiled.
- The token's embedding and the target's head stay outside, as on the DFlash step.
"""

from __future__ import annotations

from typing import Sequence

import copy

import mlx.core as mx

from speculant.core.buffers import FAR, capacity_for, padded
from speculant.drafters.mtp.mlx import LatentAttention
from speculant.drafters.mtp.mlx_cache import SequenceRows

COMPILED_ROWS = 16  # rows of a step run compiled; a longer one (the prompt) runs uncompiled


class TracedCache(SequenceRows):
    """One layer's buffers inside the trace, in the interface of ``LayerCache``; rows at ``at``."""

    def __init__(self, keys: mx.array, values: mx.array, key_at: mx.array, at: mx.array, end: mx.array) -> None:
        self.keys, self.values, self.key_at, self.at, self.end = keys, values, key_at, at, end

    def start(self, positions) -> mx.array:
        return self.at[0]

    def append(self, k: mx.array, v: mx.array, positions) -> tuple[mx.array, mx.array]:
        self.keys[:, :, self.at] = k
        self.values[:, :, self.at] = v
        self.key_at[self.at] = mx.where(self.at < self.end, self.at, FAR)  # padding rows: unwritten
        return self.keys, self.values

    def mask(self, positions) -> mx.array:
        written = self.key_at[None, :]
        return (written >= 0) & (written <= self.at[:, None])


class CompiledMTP:
    """The compiled steps of an :class:`~speculant.drafters.mtp.mlx.MTPModel`, one function per layer."""

    def __init__(self, model) -> None:
        self.model = model
        layers = len(model.blocks)
        self.buffers: list[list[mx.array]] = [[] for _ in range(layers)]  # [keys, values, key_at] per layer
        self.positions: list[list[int]] = [[] for _ in range(layers)]
        self._steps = [self._step(j) for j in range(layers)]
        self._compiled = [mx.compile(step) for step in self._steps]

    def reset(self) -> None:
        """Drop the buffers (a new request); the traces stay, keyed by shape."""
        self.buffers = [[] for _ in self.buffers]
        self.positions = [[] for _ in self.positions]

    def fork(self) -> "CompiledMTP":
        """Buffers of its own, the same compiled steps (pure functions of the arrays passed)."""
        other = copy.copy(self)
        other.reset()
        return other

    def cache_length(self, layer: int) -> int:
        return len(self.positions[layer])

    def crop(self, layer: int, length: int) -> None:
        held = self.positions[layer]
        if length < len(held) and self.buffers[layer]:
            del held[length:]
            key_at = self.buffers[layer][2]
            self.buffers[layer][2] = mx.where(key_at > (held[-1] if held else -1), FAR, key_at)

    def run(self, layer: int, embedded: mx.array, hidden: mx.array, positions: Sequence[int]):
        n, first = len(positions), positions[0]
        rows = padded(n) if n <= COMPILED_ROWS else n
        self._fit(layer, first + rows, embedded.dtype)
        if rows > n:
            embedded = mx.concatenate([embedded, mx.repeat(embedded[-1:], rows - n, axis=0)])
            hidden = mx.concatenate([hidden, mx.repeat(hidden[-1:], rows - n, axis=0)])
        step = self._compiled[layer] if n <= COMPILED_ROWS else self._steps[layer]
        at = mx.arange(first, first + rows, dtype=mx.int32)
        end = mx.array(first + n, dtype=mx.int32)
        pre, post, *self.buffers[layer] = step(embedded, hidden, at, end, *self.buffers[layer])
        self.positions[layer].extend(positions)
        return pre[:n], post[:n]

    def arrays(self, layer: int) -> list[mx.array]:
        return self.buffers[layer]

    def _fit(self, layer: int, rows: int, dtype) -> None:
        """Buffers for ``layer`` of at least ``rows`` rows, keeping what is written."""
        have = self.buffers[layer][0].shape[2] if self.buffers[layer] else 0
        size = capacity_for(rows)
        if size <= have:
            return
        heads, key_dim, value_dim = _kv_dims(self.model.blocks[layer].self_attn)
        extra = size - have
        keys = mx.zeros((1, heads, extra, key_dim), dtype=dtype)
        values = mx.zeros((1, heads, extra, value_dim), dtype=dtype)
        key_at = mx.full((extra,), FAR, dtype=mx.int32)
        if have:
            old_keys, old_values, old_key_at = self.buffers[layer]
            keys, values = mx.concatenate([old_keys, keys], axis=2), mx.concatenate([old_values, values], axis=2)
            key_at = mx.concatenate([old_key_at, key_at])
        self.buffers[layer] = [keys, values, key_at]

    def _step(self, layer: int):
        def step(embedded, hidden, at, end, keys, values, key_at):
            cache = TracedCache(keys, values, key_at, at, end)
            pre, post = self.model.step(layer, embedded, hidden, None, cache)
            return pre, post, cache.keys, cache.values, cache.key_at

        return step


def _kv_dims(attention) -> tuple[int, int, int]:
    """(heads, key dim, value dim) of what ``attention`` caches."""
    if isinstance(attention, LatentAttention):
        return attention.heads, attention.m.qk_head_dim, attention.m.v_head_dim
    return attention.kv_heads, attention.head_dim, attention.head_dim
