"""Linear products split over the CPU's cores, a CPU fast path of ``backend.compile`` on MLX.

MLX's CPU backend runs one operation at a time per stream, and the BLAS of its Linux wheel is
single-threaded, so a product uses one core however many the machine has. Here a layer stored
transposed (layout.py) keeps its weight in column blocks, one per core, and each product runs
its blocks on as many streams at once, then joins the columns. Every output column is the same
dot product as before, so the results are those of the unsplit layer (checked at load).

It pays only where a core is free and a product is large enough to outweigh the streams'
synchronisation, so the target's ``auto`` times it over its own layers at load, as the layouts
are timed, for a verify block's rows and for one row apart (one-row products of small layers
lost 13 % of a plain step on the shipped pair, split), and layers smaller than
:data:`MIN_ELEMENTS` weights are left whole. Streams are
per thread (``mx.new_thread_local_stream``), so an engine serves any thread.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from speculant.backends.mlx.layout import (CHECK_TOLERANCE, TransposedLinear, TransposedTiedEmbedding, library_key,
                                           relative_error)
from speculant.core import timing
from speculant.core.timing import usable_cores

MAX_PARTS = 4  # streams a product is split over at most
MIN_ELEMENTS = 1 << 16  # smaller layers stay whole: their products cost less than the streams' sync
BLOCK_ROWS = 8  # the rows of a verify block, as the split is timed


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


def product(x: mx.array, blocks: list[mx.array], split_rows: int) -> mx.array:
    """``split_product`` for products of at least ``split_rows`` rows; smaller ones run the blocks
    in turn on the default stream (where the streams' synchronisation outweighs the split)."""
    if x.size // x.shape[-1] >= split_rows:
        return split_product(x, blocks)
    return mx.concatenate([x @ b for b in blocks], axis=-1)


class SplitLinear(nn.Module):
    """A :class:`TransposedLinear` whose weight is kept in column blocks, multiplied at once for
    products of at least ``split_rows`` rows."""

    def __init__(self, layer: TransposedLinear, parts: int, split_rows: int = 1) -> None:
        super().__init__()
        self.blocks = column_blocks(layer.weight_t, parts)
        self.split_rows = split_rows
        if "bias" in layer:
            self.bias = layer.bias

    @property
    def weight_t(self) -> mx.array:
        return mx.concatenate(self.blocks, axis=1)

    @property
    def weight(self) -> mx.array:
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self.blocks, self.split_rows)
        return y + self.bias if "bias" in self else y

    def to_linear(self) -> nn.Linear:
        return TransposedLinear.to_linear(self)


class SplitTiedEmbedding(TransposedTiedEmbedding):
    """A tied head over a transposed copy of the table kept in column blocks."""

    def __init__(self, tied: TransposedTiedEmbedding, parts: int, split_rows: int) -> None:
        nn.Module.__init__(self)
        self.module = tied.module
        self.blocks = column_blocks(tied.weight_t, parts)
        self.split_rows = split_rows

    def as_linear(self, x: mx.array) -> mx.array:
        return product(x, self.blocks, self.split_rows)


def split_linears(model: nn.Module, inner: nn.Module | None = None, measure: bool = False,
                  split_rows: int = 1) -> tuple[int | None, str | None]:
    """Split ``model``'s large :class:`TransposedLinear` layers (and ``inner``'s transposed tied
    head) over the usable cores, for products of at least ``split_rows`` rows. With ``measure``,
    only if a verify block's products are measured faster split, and one-row products too only if
    they are (else ``split_rows`` is 2). Returns the ``split_rows`` used (None: not split) and what
    was done or why not, for ``fast_path`` (None: nothing to say)."""
    parts = min(usable_cores(), MAX_PARTS)
    found = {path: layer for path, layer in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
             if type(layer) is TransposedLinear and layer.weight_t.size >= MIN_ELEMENTS}
    if parts < 2 or not found:
        return None, None
    one_row = ""
    if measure:
        layers = list(found.values())
        key = {**library_key(layers), "parts": parts}
        gains = timing.remembered("mlx split", key, lambda: measured_speedups(layers, parts))
        gains = {int(rows): gain for rows, gain in gains.items()}  # JSON keys are strings
        if not gains[BLOCK_ROWS] >= timing.MARGIN:
            return None, f"products split over {parts} cores measured no faster ({gains[BLOCK_ROWS]:.2f}x)"
        split_rows = 1 if gains[1] >= timing.MARGIN else 2
        one_row = "" if split_rows == 1 else f"; one-row products whole (split measured {gains[1]:.2f}x)"
    done = []
    for path in list(found):
        whole = found.pop(path)  # the whole weight goes once its blocks replace it
        layer = SplitLinear(whole, parts, split_rows)
        error = _relative_error(whole, layer)
        if not error <= CHECK_TOLERANCE:  # also catches NaN
            model.update_modules(tree_unflatten([(p, TransposedLinear(d.to_linear())) for p, d in done]))
            return None, f"products left whole: {path}'s split product is {error:.2g} off (relative)"
        model.update_modules(tree_unflatten([(path, layer)]))
        done.append((path, layer))
    head = inner is not None and isinstance(inner.embed_tokens, TransposedTiedEmbedding)
    if head:
        inner.embed_tokens = SplitTiedEmbedding(inner.embed_tokens, parts, split_rows)
        mx.eval(inner.embed_tokens.blocks)
    return split_rows, f"products of {len(done)} layers{' and the head' if head else ''} split over {parts} cores{one_row}"


def measured_speedups(layers: list[TransposedLinear], parts: int) -> dict[int, float]:
    """Time whole over time split, over ``layers`` in order up to the working set, for a plain
    step's row and for a verify block's, each on its own (core/timing.py)."""
    sample = timing.working_set(layers, lambda layer: layer.weight_t.nbytes)
    split = [SplitLinear(layer, parts) for layer in sample]
    mx.eval([layer.blocks for layer in split])
    gains = {}
    for rows in (1, BLOCK_ROWS):
        xs = [mx.random.normal((rows, layer.weight_t.shape[0]), key=mx.random.key(rows)) for layer in sample]
        mx.eval(xs)
        gains[rows] = timing.speedup(_chained(sample, xs), _chained(split, xs))
    return gains


def _chained(layers: list, xs: list[mx.array]):
    """The products one after another, as in a forward: each input waits for the last output
    (independent products would overlap on the streams and flatter the split)."""
    def run() -> None:
        wait = mx.array(0.0)
        for layer, x in zip(layers, xs):
            wait = layer(x + wait)[0, 0] * 0.0
        mx.eval(wait)
    return run


def _relative_error(whole: TransposedLinear, split: SplitLinear) -> float:
    x = mx.random.normal((3, whole.weight_t.shape[0]), key=mx.random.key(0))
    return relative_error(whole(x), split(x))
