"""Linear products split over the CPU's cores, a CPU fast path of ``backend.compile`` on MLX.

MLX's CPU backend runs one operation at a time per stream, and the BLAS of its Linux wheel is
single-threaded, so a product uses one core however many the machine has. Here a layer stored
transposed (layout.py) keeps its weight in column blocks, one per core, and each product runs
its blocks on as many streams at once, then joins the columns. Every output column is the same
dot product as before, so the results are those of the unsplit layer (checked at load).

It pays only where a core is free and a product is large enough to outweigh the streams'
synchronisation, so the target's ``auto`` times it over its own layers at load, as the layouts
are timed, and layers smaller than :data:`MIN_ELEMENTS` weights are left whole. Streams are
per thread (``mx.new_thread_local_stream``), so an engine serves any thread.
"""

from __future__ import annotations

import os
from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from speculant.backends.mlx.layout import CHECK_TOLERANCE, MEASURED_ROWS, TransposedLinear, TransposedTiedEmbedding
from speculant.core import timing

MAX_PARTS = 4  # streams a product is split over at most
MIN_ELEMENTS = 1 << 16  # smaller layers stay whole: their products cost less than the streams' sync


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@cache
def _extra_streams(parts: int) -> tuple:
    return tuple(mx.new_thread_local_stream(mx.cpu) for _ in range(parts - 1))


def column_blocks(weight_t: mx.array, parts: int) -> list[mx.array]:
    edges = [round(i * weight_t.shape[1] / parts) for i in range(parts + 1)]
    return [mx.contiguous(weight_t[:, a:b]) for a, b in zip(edges, edges[1:])]


def split_product(x: mx.array, blocks: list[mx.array]) -> mx.array:
    """``x @ concatenate(blocks, axis=1)``, the first block on the default stream and each other
    one on a stream of its own."""
    first, *rest = blocks
    outs = [x @ first] + [mx.matmul(x, b, stream=s) for b, s in zip(rest, _extra_streams(len(blocks)))]
    return mx.concatenate(outs, axis=-1)


class SplitLinear(nn.Module):
    """A :class:`TransposedLinear` whose weight is kept in column blocks, multiplied at once."""

    def __init__(self, layer: TransposedLinear, parts: int) -> None:
        super().__init__()
        self.blocks = column_blocks(layer.weight_t, parts)
        if "bias" in layer:
            self.bias = layer.bias

    @property
    def weight_t(self) -> mx.array:
        return mx.concatenate(self.blocks, axis=1)

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        y = split_product(x, self.blocks)
        return y + self.bias if "bias" in self else y

    def to_linear(self) -> nn.Linear:
        return TransposedLinear.to_linear(self)


class SplitTiedEmbedding(TransposedTiedEmbedding):
    """A tied head over a transposed copy of the table kept in column blocks."""

    def __init__(self, tied: TransposedTiedEmbedding, parts: int) -> None:
        nn.Module.__init__(self)
        self.module = tied.module
        self.blocks = column_blocks(tied.weight_t, parts)

    def as_linear(self, x: mx.array) -> mx.array:
        return split_product(x, self.blocks)


def split_linears(model: nn.Module, inner: nn.Module | None = None, measure: bool = False) -> tuple[bool, str | None]:
    """Split ``model``'s large :class:`TransposedLinear` layers (and ``inner``'s transposed tied
    head) over the usable cores; with ``measure``, only if measured faster here. Returns whether
    it did, and what was done or why not for ``fast_path`` (None: nothing to say)."""
    parts = min(usable_cores(), MAX_PARTS)
    found = {path: layer for path, layer in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
             if type(layer) is TransposedLinear and layer.weight_t.size >= MIN_ELEMENTS}
    if parts < 2 or not found:
        return False, None
    if measure:
        gain = measured_speedup(list(found.values()), parts)
        if not gain >= timing.MARGIN:
            return False, f"products split over {parts} cores measured no faster ({gain:.2f}x)"
    done = []
    for path in list(found):
        whole = found.pop(path)  # the whole weight goes once its blocks replace it
        layer = SplitLinear(whole, parts)
        error = _relative_error(whole, layer)
        if not error <= CHECK_TOLERANCE:  # also catches NaN
            model.update_modules(tree_unflatten([(p, TransposedLinear(d.to_linear())) for p, d in done]))
            return False, f"products left whole: {path}'s split product is {error:.2g} off (relative)"
        model.update_modules(tree_unflatten([(path, layer)]))
        done.append((path, layer))
    head = inner is not None and isinstance(inner.embed_tokens, TransposedTiedEmbedding)
    if head:
        inner.embed_tokens = SplitTiedEmbedding(inner.embed_tokens, parts)
        mx.eval(inner.embed_tokens.blocks)
    return True, f"products of {len(done)} layers{' and the head' if head else ''} split over {parts} cores"


def measured_speedup(layers: list[TransposedLinear], parts: int) -> float:
    """Time whole over time split, over ``layers`` in order up to the working set, on a plain
    step's row and a verify block's (core/timing.py)."""
    sample = timing.working_set(layers, lambda layer: layer.weight_t.nbytes)
    split = [SplitLinear(layer, parts) for layer in sample]
    xs = [[mx.random.normal((rows, layer.weight_t.shape[0]), key=mx.random.key(rows)) for rows in MEASURED_ROWS]
          for layer in sample]
    mx.eval(xs, [layer.blocks for layer in split])

    def run(group):
        return lambda: mx.eval([layer(x) for layer, inputs in zip(group, xs) for x in inputs])

    return timing.speedup(run(sample), run(split))


def _relative_error(whole: TransposedLinear, split: SplitLinear) -> float:
    x = mx.random.normal((3, whole.weight_t.shape[0]), key=mx.random.key(0))
    want = whole(x)
    scale = mx.abs(want).max().item() or 1.0
    return mx.abs(split(x) - want).max().item() / scale
