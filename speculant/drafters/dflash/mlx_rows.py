"""Several sequences' DFlash blocks in one MLX draft forward (issue #39's batched requests); the
MLX twin of :mod:`speculant.drafters.dflash.torch_rows`.

Each sequence keeps its own :class:`~speculant.drafters.dflash.context.ContextCache` (its fork's
network). Their new context rows are projected in one pass and committed to each cache; the
forward stacks the blocks [rows, q, H] and, per layer, lays every row's context keys/values
left-aligned in N zero-padded slots ([rows, kv_heads, N + q, hd]) with its block after them.
:func:`speculant.drafters.dflash.visibility.rows_keep` hides the padding, what each row's own
causal/window rules hide, and the block rows past a narrower row's width, so every row attends
exactly as its own forward would. RoPE takes each row's block position as an array of offsets
(:class:`~speculant.drafters.dflash.mlx.RowPositions`).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from speculant.drafters.dflash.context import ContextCache
from speculant.drafters.dflash.mlx import RowPositions
from speculant.drafters.dflash.visibility import caches_keep


class PaddedRows:
    """One layer's context of every row, joined with the rows' blocks ([rows, kv_heads, n, hd])."""

    def __init__(self, caches: Sequence[ContextCache], layer: int) -> None:
        self.caches, self.layer = caches, layer
        self.length = max(c.length(layer) for c in caches)

    def join(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        views = [c.view(self.layer) for c in self.caches]  # each [1, kv_heads, n_r, hd]
        keys = mx.concatenate([mx.concatenate([self._padded(ck) for ck, _ in views]), k], axis=2)
        values = mx.concatenate([mx.concatenate([self._padded(cv) for _, cv in views]), v], axis=2)
        return keys, values

    def _padded(self, rows: mx.array) -> mx.array:
        missing = self.length - rows.shape[2]
        return mx.pad(rows, [(0, 0), (0, 0), (0, missing), (0, 0)]) if missing else rows

    def mask(self, positions: Sequence[int], widths: Sequence[int], q: int, causal: bool, window) -> mx.array:
        """The keep-mask [rows, 1, q, N + q] (shared by every head)."""
        return mx.array(caches_keep(self.caches, self.layer, positions, widths, q, causal, window))[:, None]


def take_in_rows(nets: Sequence, contexts: Sequence[tuple[mx.array, int]]) -> None:
    """Commit ``contexts[r]`` (new feature rows, position of the first) to ``nets[r]``'s cache in
    every layer: projected and given keys/values in one pass over all rows, each row's keys
    rotated from its own position."""
    m, dtype = nets[0].model, nets[0].dtype
    features = [f for f, _ in contexts]
    ctx = m.project_context(mx.concatenate(features).astype(dtype))[None]  # [1, sum of rows, H]
    ends, end = [], 0
    for f in features:
        end += f.shape[0]
        ends.append(end)
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        k, v = attn.keys_values(ctx)
        for net, (f, start), end in zip(nets, contexts, ends):
            n = f.shape[0]
            if n:
                net.cache.append(i, attn.rotate(k[:, :, end - n:end], start), v[:, :, end - n:end], start)


def hidden_rows(nets: Sequence, contexts: Sequence[tuple[mx.array, int]], block_ids: Sequence[Sequence[int]],
                positions: Sequence[int], widths: Sequence[int]) -> mx.array:
    """Final-normed rows 1.. of every row's block ([rows, q - 1, H]): ``nets[r]`` (eager
    ``MLXDFlashNetwork`` forks over one model) takes in ``contexts[r]`` (new feature rows and
    the position of the first) and drafts ``block_ids[r]`` at ``positions[r]``; rows past
    ``widths[r] + 1`` are filler, cut by the caller."""
    net = nets[0]
    m, cfg = net.model, net.cfg
    ids = mx.array(block_ids, dtype=mx.int32)
    rows, q = ids.shape
    take_in_rows(nets, contexts)
    x = net.target.embed(ids.reshape(-1), raw=True).astype(net.dtype).reshape(rows, q, -1)
    if cfg.input_embedding_scale != 1.0:
        x = x * cfg.input_embedding_scale
    at = RowPositions(tuple(positions), tuple(w + 1 for w in widths), mx.array(positions, dtype=mx.int32))
    no_context = x[:, :0]  # every row's new context is committed above
    caches = [each.cache for each in nets]
    masks: dict = {}
    for i, layer in enumerate(m.layers):
        context = PaddedRows(caches, i)
        kind = (layer.causal, layer.window)  # layers alike hold the same context rows
        if kind not in masks:
            masks[kind] = context.mask(positions, widths, q, *kind)
        x = layer(x, no_context, 0, at, context, masks[kind])
    return m.norm(x[:, 1:])
