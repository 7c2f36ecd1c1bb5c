"""The DFlash (and DFlash2) draft step on MLX under ``mx.compile``, used when the target's whole
forward runs compiled (``speculant/backends/mlx/static.py``).

The eager :class:`~speculant.drafters.dflash.context.ContextCache` slices its buffers at Python
ints, which a trace would bake in. The compiled step keeps its own buffers instead, laid out as
the PyTorch compiled step's (``compiled.py``), and passes them through the compiled function as
arrays:

- **Rows by position.** Per layer, key/value buffers ``[1, kv_heads, rows, hd]``; position ``p``
  lives in row ``p % rows`` and each row's position is kept in ``key_positions`` (``FAR`` until
  written). The step writes the new context rows and the block's rows there (a scatter at rows
  computed in the trace) and attends over every row with a keep-mask computed from those
  positions and ``where`` = [context start, block position, block end]: rows at or past the
  block's end are masked (rejected blocks, padding, a withdrawn draft ahead), and a sliding or
  causal layer's own limits apply as in the eager mask. Nothing needs rolling back.
- **Shapes.** New context rows are padded to a power of two (a cycle commits 1 .. block rows) and
  the block to the engine's block width, so ``mx.compile`` traces once per (context bucket, block,
  buffer rows). The buffers grow as ``speculant.core.buffers.capacity_for`` says, since attention
  reads every row. A longer context (the prompt) runs the same function uncompiled.
- **Ring.** When every layer slides, a block sees only the ``reach = max(window) - 1`` positions
  before it, so the buffers stop growing at ``reach`` plus two padded blocks, and positions wrap
  round them from then on: a long request never grows them or traces again. No row a step reads
  is overwritten in that step.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from speculant.core.buffers import FAR, capacity_for, padded
from speculant.drafters.dflash.visibility import keep_by_distance


class StaticSlot:
    """One layer's buffers in the trace, written at the context's and the block's rows (the
    ``context`` an :class:`~speculant.drafters.dflash.mlx.Attention` appends to and joins)."""

    def __init__(self, keys: mx.array, values: mx.array, ctx_rows: mx.array, block_rows: mx.array) -> None:
        self.keys, self.values, self.ctx_rows, self.block_rows = keys, values, ctx_rows, block_rows

    def append(self, k: mx.array, v: mx.array, start, reserve: int = 0) -> None:
        self.keys[:, :, self.ctx_rows] = k
        self.values[:, :, self.ctx_rows] = v

    def join(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        self.keys[:, :, self.block_rows] = k
        self.values[:, :, self.block_rows] = v
        return self.keys, self.values


class CompiledDraft:
    """The compiled draft step of a :class:`~speculant.drafters.dflash.mlx.DFlashModel`."""

    def __init__(self, model, block: int) -> None:
        self.model = model
        self.block = block
        windows = [layer.window for layer in model.layers]
        self.reach = None if any(w is None for w in windows) else max(windows) - 1
        self.ring = None if self.reach is None else self.reach + 2 * padded(block)
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.key_positions: mx.array | None = None  # each row's position (FAR: never written)
        self._compiled = mx.compile(self._step)

    def reset(self) -> None:
        """Drop the buffers (a new request); the traces stay, keyed by shape."""
        self.keys, self.values, self.key_positions = [], [], None

    def fork(self) -> "CompiledDraft":
        """Buffers of its own, the same compiled function (a pure function of the arrays passed)."""
        other = copy.copy(self)
        other.reset()
        return other

    @property
    def rows(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def context_rows(self, layer: int, end: int) -> tuple[int, mx.array, mx.array]:
        """(first position, keys, values) of the context rows before ``end`` still held: all of
        them, or a ring's last ``reach`` (position ``p`` lives in row ``p % rows``)."""
        first = 0 if self.reach is None else max(0, end - self.reach)
        at = mx.arange(first, end, dtype=mx.int32) % self.rows
        return first, self.keys[layer][:, :, at], self.values[layer][:, :, at]

    def arrays(self) -> list[mx.array]:
        return [*self.keys, *self.values, self.key_positions] if self.keys else []

    def _fit(self, rows: int, k_like: tuple[int, int, mx.Dtype]) -> None:
        """Buffers of at least ``rows`` rows, keeping what is written; a ring stops growing at its
        size (its rows were positions until then, so wrapping on from there is consistent)."""
        size = capacity_for(rows) if self.ring is None else min(capacity_for(rows), self.ring)
        if size <= self.rows:
            return
        kv_heads, head_dim, dtype = k_like
        extra = size - self.rows
        pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
        for store in (self.keys, self.values):
            for i in range(len(self.model.layers)):
                if i < len(store):
                    store[i] = mx.pad(store[i], pad)
                else:
                    store.append(mx.zeros((1, kv_heads, size, head_dim), dtype=dtype))
        far = mx.full((extra,), FAR, dtype=mx.int32)
        self.key_positions = far if self.key_positions is None else mx.concatenate([self.key_positions, far])

    def hidden(self, features: mx.array, start: int, x: mx.array, position: int) -> mx.array:
        """Like ``MLXDFlashNetwork.hidden`` from the embedded block ``x`` [b, H]."""
        n, b = features.shape[0], x.shape[0]
        width = max(self.block, b)
        attn = self.model.layers[0].self_attn
        self._fit(max(start + n, position + width), (attn.kv_heads, attn.head_dim, x.dtype))
        step = self._step
        if n <= self.block:  # a cycle's rows: padded to a traced shape (the prompt runs eagerly)
            step = self._compiled
            bucket = padded(n)
            features = mx.concatenate([features, mx.repeat(features[-1:], bucket - n, axis=0)])
        x = mx.concatenate([x, mx.repeat(x[-1:], width - b, axis=0)])
        where = mx.array([start, position, position + b], dtype=mx.int32)
        out = step(features, x, where, *self.arrays())
        layers = len(self.model.layers)
        self.keys, self.values = list(out[1:1 + layers]), list(out[1 + layers:1 + 2 * layers])
        self.key_positions = out[-1]
        return out[0][: b - 1]

    def _step(self, features: mx.array, x: mx.array, where: mx.array, *buffers: mx.array) -> list[mx.array]:
        """[final-normed block rows 1.., keys.., values.., (key positions)]: arrays only."""
        m, layers = self.model, len(self.model.layers)
        keys, values = list(buffers[:layers]), list(buffers[layers:2 * layers])
        start, position, limit = where[0], where[1], where[2]
        ctx_at = start + mx.arange(features.shape[0], dtype=mx.int32)
        block_at = position + mx.arange(x.shape[0], dtype=mx.int32)
        size = keys[0].shape[2]
        ctx_rows, block_rows = ctx_at % size, block_at % size
        key_at = buffers[-1]  # each row's position; the block's rows are written after the context's
        key_at[ctx_rows] = ctx_at
        key_at[block_rows] = block_at
        ctx = m.project_context(features)[None]
        h = x[None]
        masks: dict = {}
        for i, layer in enumerate(m.layers):
            kind = (layer.causal, layer.window)
            if kind not in masks:
                rel = block_at[:, None] - key_at[None, :]  # query - key
                keep = mx.broadcast_to(((key_at >= 0) & (key_at < limit))[None, :], rel.shape)
                masks[kind] = keep_by_distance(keep, rel, *kind)
            slot = StaticSlot(keys[i], values[i], ctx_rows, block_rows)
            h = layer(h, ctx, start, position, slot, masks[kind])
            keys[i], values[i] = slot.keys, slot.values
        return [m.norm(h[0, 1:]), *keys, *values, key_at]
