"""The whole target forward under ``mx.compile``, over a cache whose write position is an array.

mlx-lm's ``KVCache`` keeps its write position as a Python int, which ``mx.compile`` would bake
into a trace. :class:`StaticKVCache` instead holds each layer's keys/values in a preallocated
buffer that a forward writes with ``mx.slice_update`` at ``offset``, an ``mx.array``, and its
``make_mask`` hides every row at or past ``offset + query``. RoPE reads the same array offset
(``mx.fast.rope`` takes one). A compiled forward then depends only on the block width and the
buffers' capacity, so it is traced once per (width, capacity): 1 for plain steps, ``w`` for a
verify block, capacities as ``speculant.core.buffers.capacity_for`` gives them.

Rolling back costs nothing: the target's length is the next forward's offset, and rows past it
are masked until they are overwritten. The buffers are kept across requests.

Only targets whose layers all use mlx-lm's plain ``KVCache`` qualify (sliding-window and Gated
DeltaNet layers keep their own caches, ``caches.py``). A model whose attention code reads the
offset as an int, or builds its own mask, could still compute something else over these
buffers, so :meth:`StaticForward.check` compares one forward against mlx-lm's cache at load and
the target stays eager, with the reason in ``fast_path``, where they differ.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from speculant.backends.mlx import threads
from speculant.backends.mlx.layout import relative_error
from speculant.core.buffers import capacity_for
from speculant.core.types import Capture

CHECK_TOLERANCE = 1e-4  # largest |static - mlx-lm| logit difference, relative to the logits' scale
CHECK_ROWS = 5  # prompt rows of the load-time check; then a block of 3


class StaticKVCache:
    """One full-attention layer's keys/values ``[1, kv_heads, capacity, head_dim]``, written at
    ``offset`` (set by :class:`StaticForward` before each forward)."""

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: mx.array = mx.array(0, dtype=mx.int32)
        self.capacity = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:  # the first, eager, forward sets the shapes
            self.keys = mx.zeros((*keys.shape[:2], self.capacity, keys.shape[3]), dtype=keys.dtype)
            self.values = mx.zeros((*values.shape[:2], self.capacity, values.shape[3]), dtype=values.dtype)
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Keep-mask [n, capacity]: query ``i`` sees rows ``0 .. offset + i``."""
        if window_size is not None:
            raise NotImplementedError("a static cache serves full-attention layers only")
        rows = self.offset + mx.arange(n, dtype=mx.int32)
        return mx.arange(self.capacity, dtype=mx.int32)[None, :] <= rows[:, None]

    def grow(self, capacity: int) -> None:
        if self.keys is not None:
            extra = capacity - self.keys.shape[2]
            pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
            self.keys, self.values = mx.pad(self.keys, pad), mx.pad(self.values, pad)
        self.capacity = capacity

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def trim(self, n: int) -> int:
        return n  # the target's length is the next offset; rows past it are masked


def qualifies(caches: list) -> bool:
    """Whether every layer of a target uses mlx-lm's plain full-attention cache."""
    return bool(caches) and all(type(c) is KVCache for c in caches)


class StaticForward:
    """Forwards of ``model`` over :class:`StaticKVCache` layers, compiled per (capture, width,
    capacity) when ``compiled`` (eager otherwise: the prompt's chunks, which vary in width)."""

    def __init__(self, model: nn.Module, layers: int, finish: Callable[[Capture], tuple], start: Callable) -> None:
        self.model = model
        self.cache = [StaticKVCache() for _ in range(layers)]
        self._start, self._finish = start, finish  # the target's hidden-state recorder
        self._compiled: dict[Capture, Callable] = {}

    def reset(self) -> None:
        """Drop the buffers: a short request after a long one should not attend over its rows."""
        for c in self.cache:
            c.keys = c.values = None
            c.capacity = 0

    def __call__(self, ids: mx.array, offset: int, capture: Capture, compiled: bool = True):
        """Logits [1, n, vocab] and the captured (features, final) of ``ids`` [1, n] at ``offset``."""
        threads.register()
        need = offset + int(ids.shape[1])
        if need > self.cache[0].capacity:
            for c in self.cache:
                c.grow(capacity_for(need))
        first = self.cache[0].keys is None  # eager: it allocates the buffers
        buffers = [] if first else [a for c in self.cache for a in (c.keys, c.values)]
        fn = self._compiled_for(capture) if compiled and not first else self._eager_for(capture)
        logits, *rest = fn(ids, mx.array(offset, dtype=mx.int32), *buffers)
        captured = int(bool(capture.layer_ids)) + int(capture.final_hidden is not None)
        for i, c in enumerate(self.cache):
            c.keys, c.values = rest[captured + 2 * i], rest[captured + 2 * i + 1]
        features = rest[0] if capture.layer_ids else None
        final = rest[captured - 1] if capture.final_hidden is not None else None
        return logits, features, final

    def _eager_for(self, capture: Capture) -> Callable:
        return lambda ids, position, *buffers: self._step(capture, ids, position, *buffers)

    def _compiled_for(self, capture: Capture) -> Callable:
        fn = self._compiled.get(capture)
        if fn is None:
            fn = self._compiled[capture] = mx.compile(self._eager_for(capture))
        return fn

    def _step(self, capture: Capture, ids: mx.array, position: mx.array, *buffers: mx.array) -> list[mx.array]:
        """[logits, captured arrays.., keys and values of every layer..]: arrays only, as
        ``mx.compile`` needs."""
        for i, c in enumerate(self.cache):
            c.offset = position
            if buffers:
                c.keys, c.values = buffers[2 * i], buffers[2 * i + 1]
        self._start(capture)
        try:
            logits = self.model(ids, cache=self.cache)
        except BaseException:
            self._start(Capture())
            raise
        captured = [a for a in self._finish(capture) if a is not None]
        return [logits, *captured, *[a for c in self.cache for a in (c.keys, c.values)]]


def build(model: nn.Module, caches: list, start: Callable, finish: Callable) -> tuple[StaticForward | None, str]:
    """A checked :class:`StaticForward` for ``model`` (whose mlx-lm cache is ``caches``), or None
    and why not."""
    if not qualifies(caches):
        kinds = sorted({type(c).__name__ for c in caches if type(c) is not KVCache})
        return None, f"its layers' caches ({', '.join(kinds)}) are not all full attention"
    forward = StaticForward(model, len(caches), finish, start)
    error = check(model, forward)
    if error is not None:
        return None, error
    return forward, f"{len(caches)} full-attention layers over a static cache"


def check(model: nn.Module, forward: StaticForward) -> str | None:
    """Compare a prompt and a compiled block against mlx-lm's own cache; None when they agree."""
    prompt = mx.arange(1, CHECK_ROWS + 1, dtype=mx.int32)[None]
    block = mx.arange(2, 5, dtype=mx.int32)[None]
    kv = [KVCache() for _ in forward.cache]
    try:
        expected = [model(prompt, cache=kv), model(block, cache=kv)]
        got = [forward(prompt, 0, Capture(), compiled=False)[0], forward(block, CHECK_ROWS, Capture())[0]]
        mx.eval(expected, got)
    except Exception as error:  # a model whose attention code cannot run over array offsets
        return f"a compiled forward failed: {type(error).__name__}: {error}"
    for want, have in zip(expected, got):
        error = relative_error(want, have)
        if not error <= CHECK_TOLERANCE:
            return f"a compiled forward differed from mlx-lm's cache by {error:.1e} (relative) at load"
    return None
