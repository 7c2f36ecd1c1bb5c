"""Tree verify forwards over an MLX target's caches (docs/tree-verification.md).

mlx-lm's attention reads neither positions nor a mask from its caller: it rotates a block at
``cache.offset, offset + 1, ...`` and asks the cache for its mask. During one tree forward,
:func:`tree_forward` therefore (1) has every attention cache answer ``make_mask`` with the tree's
visibility (``DraftTree.visibility``: the cached rows the layer returns, then ancestors only) and
(2) swaps each attention's ``rope`` for :class:`TreeRope`, which rotates the nodes of depth ``d``
at ``offset + d``. Both are undone when the forward returns. :func:`commit_path` then moves the
accepted path's rows to the positions after the prefix, in full (``KVCache``) and sliding
(``WindowKVCache``) caches alike.

Gated DeltaNet layers (``DeltaCache``): with ``caches.TREE`` set, the tapped convolution computes
each node from its ancestors' inputs (then the cached window) (:func:`tree_conv`) and the
per-position delta rule starts each node from its parent's state; the commit keeps the cached
window plus the path's inputs and the state of the path's last node.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from speculant.backends.mlx import caches as cache_kinds
from speculant.backends.mlx.caches import DeltaCache, WindowKVCache
from speculant.backends.mlx.static import StaticKVCache
from speculant.backends.mlx.wrapper import Wrapper
from speculant.core.tree import DraftTree, conv_windows, kept_rows


class TreeRope(Wrapper):
    """The wrapped rotary embedding applied per tree depth: nodes of depth ``d`` at ``offset + d``.
    The nodes move to the batch axis, each a one-row sequence with its own offset, so that one
    call rotates them all (a call per depth, then a slice per node, cost a chain of 9 as a tree
    twice its compiled forward on the shipped pair)."""

    def __init__(self, module: nn.Module, depths: Sequence[int]) -> None:
        super().__init__(module)
        self.depths = mx.array(depths)

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        moved = mx.swapaxes(x, 0, -2)  # [nodes, H, B, D]: a batch of one-row sequences (B is 1)
        return mx.swapaxes(self.module(moved, offset=offset + self.depths), 0, -2)


class RowsRope(Wrapper):
    """The wrapped rotary embedding at each batch row's own positions ``[rows, width]`` (a batch
    whose rows hold trees: node ``j`` of a row at its length + its depth), every (row, column) a
    one-row sequence of the batch axis, so that one call rotates them all."""

    def __init__(self, module: nn.Module, positions: mx.array) -> None:
        super().__init__(module)
        self.positions = positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        rows, heads, width, dim = x.shape
        moved = mx.transpose(x, (0, 2, 1, 3)).reshape(rows * width, heads, 1, dim)
        turned = self.module(moved, offset=self.positions.reshape(-1))
        return mx.transpose(turned.reshape(rows, width, heads, dim), (0, 2, 1, 3))


@contextmanager
def rows_positions(attentions: list, positions: mx.array) -> Iterator[None]:
    """Within: a model's ``attentions`` (:func:`attention_modules`) rotate row ``r``'s column
    ``j`` at ``positions[r, j]``."""
    ropes = [a["rope"] for a in attentions]
    for a, rope in zip(attentions, ropes):
        a.rope = RowsRope(rope, positions)
    try:
        yield
    finally:
        for a, rope in zip(attentions, ropes):
            a.rope = rope


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """``model``'s modules that hold a rotary embedding as ``rope`` (a walk over every module:
    a target keeps the list rather than walk it every tree forward)."""
    return [m for _, m in model.named_modules() if isinstance(m.get("rope") if hasattr(m, "get") else None, nn.Module)]


def rope_problem(model: nn.Module, caches: list) -> str | None:
    """Why tree positions cannot be placed in ``model``: every attention cache needs one attention
    module whose rotary embedding is its ``rope`` (what :class:`TreeRope` replaces), or one that
    says it has none (``use_rope = False``: Muse Glimmer's full layers read no positions)."""
    without = sum(1 for _, m in model.named_modules() if getattr(m, "use_rope", None) is False)
    attentions = len(attention_modules(model)) + without
    kv = sum(1 for c in caches if hasattr(c, "keys"))
    if attentions == kv:
        return None
    return (f"{attentions} attention modules hold a `rope` for {kv} attention caches, so tree positions "
            "(prefix + depth) cannot be placed in this model's attention")


@contextmanager
def tree_forward(attentions: list, caches: list, tree: DraftTree) -> Iterator[None]:
    """Within: forwards of a model (its ``attentions``: :func:`attention_modules`) over ``caches``
    run ``tree``'s nodes (positions and masks)."""
    ropes = [a["rope"] for a in attentions]
    for a, rope in zip(attentions, ropes):
        a.rope = TreeRope(rope, tree.depths)
    attention_caches = [c for c in caches if not isinstance(c, DeltaCache)]
    for c in attention_caches:
        c.make_mask = _mask_of(c, tree)
    cache_kinds.TREE.parents, cache_kinds.TREE.conv = tree.parents, tree_conv
    try:
        yield
    finally:
        cache_kinds.TREE.parents = cache_kinds.TREE.conv = None
        for a, rope in zip(attentions, ropes):
            a.rope = rope
        for c in attention_caches:
            del c.make_mask


def _mask_of(cache, tree: DraftTree):
    if isinstance(cache, StaticKVCache):
        return _static_mask_of(cache, tree) if cache.window is None else _ring_mask_of(cache, tree)
    sliding = isinstance(cache, WindowKVCache)
    cached = cache._kept() if sliding else int(cache.offset)
    mask = mx.array(tree.visibility(cached, cache.window if sliding else None))

    def make_mask(N: int, *args, **kwargs) -> mx.array:
        return mask

    return make_mask


def _static_mask_of(cache: StaticKVCache, tree: DraftTree):
    """A full-attention static buffer (row = position) has ``capacity`` rows, sized only once the
    forward starts: the prefix, then the tree's rows as ``DraftTree.visibility``, then nothing."""

    def make_mask(N: int, *args, **kwargs) -> mx.array:
        cached = int(cache.offset.item()) if isinstance(cache.offset, mx.array) else int(cache.offset)
        visible = tree.visibility(cached)
        mask = np.zeros((tree.size, cache.capacity), dtype=bool)
        mask[:, :visible.shape[1]] = visible
        return mx.array(mask)

    return make_mask


def _ring_mask_of(cache: StaticKVCache, tree: DraftTree):
    """A sliding layer's static ring (position p at row p % capacity, at least window - 1 + T rows):
    the tree's node i is written at row (offset + i) % capacity. Each row's position follows from
    the offset (static.py), so a node sees the rows before the tree within its window from its own
    position (offset + depth), then its ancestors' rows."""

    def make_mask(N: int, *args, **kwargs) -> mx.array:
        offset = int(cache.offset.item()) if isinstance(cache.offset, mx.array) else int(cache.offset)
        held = np.array(cache.held(offset + tree.size - 1))  # each row's position (or node, from offset on)
        at = offset + np.asarray(tree.depths)[:, None]
        mask = (held[None, :] >= 0) & (held[None, :] < offset) & (held[None, :] > at - cache.window)
        nodes = held >= offset
        mask[:, nodes] = tree.ancestor_mask()[:, held[nodes] - offset]
        return mx.array(mask)

    return make_mask


def commit_path(caches: list, length: int, tree: DraftTree, path: Sequence[int]) -> None:
    """Keep each cache's rows before ``length`` and then the rows of the nodes ``path``."""
    rows = kept_rows(tree, path)
    for c in caches:
        if isinstance(c, DeltaCache):
            _commit_delta(c, tree.size, rows)
            continue
        if isinstance(c, StaticKVCache) and c.window is not None:  # a ring: rows modulo its capacity
            source = [(length + r) % c.capacity for r in rows]
            target = mx.array([(length + k) % c.capacity for k in range(len(rows))])
        else:
            base = length - getattr(c, "start", 0)  # buffer row of the root (sliding buffers start later)
            source, target = [base + r for r in rows], slice(base, base + len(rows))
        index = mx.array(source)
        c.keys[:, :, target] = mx.take(c.keys, index, axis=2)
        c.values[:, :, target] = mx.take(c.values, index, axis=2)
        c.offset = length + len(rows)


def _commit_delta(cache: DeltaCache, width: int, rows: list[int]) -> None:
    """The convolution window after the path's inputs; the recurrent state of its last node."""
    if cache.conv_input is None or len(cache.states) != width:
        raise RuntimeError("a Gated DeltaNet layer recorded no per-node states for the tree just verified")
    cached = cache.conv_input.shape[1] - width  # kernel - 1
    inputs = mx.concatenate([cache.conv_input[:, :cached], mx.take(cache.conv_input, mx.array([cached + r for r in rows]),
                                                                    axis=1)], axis=1)
    cache[0] = mx.contiguous(inputs[:, -cached:, :])
    cache[1] = cache.states[rows[-1]]
    cache.forget()


def tree_conv(conv: nn.Module, x: mx.array, parents: Sequence[int]) -> mx.array:
    """A depthwise ``conv`` (mlx ``Conv1d``, no padding) over ``x`` [B, kernel - 1 + T, C] whose last
    T rows are tree nodes: node ``i``'s window is its ancestors' rows, then the cached rows."""
    weight = conv.weight  # [C, kernel, 1]
    kernel, nodes = int(weight.shape[1]), len(parents)
    cached = int(x.shape[1]) - nodes
    windows = conv_windows(parents, kernel, cached)
    gathered = mx.take(x, mx.array(windows), axis=1)  # [B, T, kernel, C]
    out = (gathered * mx.transpose(weight[:, :, 0])).sum(axis=2)
    if "bias" in conv:
        out = out + conv.bias
    return out
