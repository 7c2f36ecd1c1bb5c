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

Sliding-window layers (``WindowKVCache`` in ``caches.py``) keep a ring instead: the window before
a block plus the block, so a long request reads and traces no more for them. Gated DeltaNet layers
pass their conv and recurrent states through the compiled forward, and a verify forward also
returns each one's state after every position, so ``DeltaCache.trim`` rolls them back as in the
eager forward. A model whose attention code reads the offset as an int, or builds its own mask,
could still compute something else over these buffers, so :func:`check` compares a prompt and a
block with the rollback caches at load and the target stays eager, with the reason in
``fast_path``, where they differ.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from speculant.backends.mlx import threads
from speculant.backends.mlx.caches import DeltaCache, WindowKVCache, recording
from speculant.backends.mlx.layout import relative_error
from speculant.core.buffers import capacity_for
from speculant.core.types import Capture

CHECK_TOLERANCE = 1e-4  # largest |static - mlx-lm| logit difference, relative to the logits' scale
CHECK_ROWS = 5  # prompt rows of the load-time check; then a block of 3


class StaticKVCache:
    """One attention layer's keys/values ``[1, kv_heads, capacity, head_dim]``, written at
    ``offset`` (set by :class:`StaticForward` before each forward).

    A full-attention layer's buffers grow with the sequence, and position ``p`` is row ``p``. A
    sliding-window layer's (``window``) stop growing at ``window - 1`` plus the widest forward's
    rows and wrap round: position ``p`` is row ``p % capacity``, written by a scatter. Which
    position a row holds after a forward follows from the offset alone (the latest one with that
    residue), so the mask needs no record of what was written. That holds for rows a rejected
    block left behind too: with at least ``window - 1 + w`` rows after a forward of width ``w``,
    such a row either is rewritten by the next forward or holds, for every query of it, a
    position past the query or out of its window.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: mx.array = mx.array(0, dtype=mx.int32)
        self.capacity = 0
        self.written = 0  # the end of the furthest forward so far (rows wrapped when > capacity)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:  # the first, eager, forward sets the shapes
            self.keys = mx.zeros((*keys.shape[:2], self.capacity, keys.shape[3]), dtype=keys.dtype)
            self.values = mx.zeros((*values.shape[:2], self.capacity, values.shape[3]), dtype=values.dtype)
        if self.window is None:
            start = self.offset.reshape(1)
            self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
            self.values = mx.slice_update(self.values, values, start, axes=(2,))
        else:
            rows = (self.offset + mx.arange(keys.shape[2], dtype=mx.int32)) % self.capacity
            self.keys[:, :, rows] = keys
            self.values[:, :, rows] = values
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """Keep-mask [n, capacity]: query ``offset + i`` sees the rows holding positions up to
        its own and, for a sliding layer, within its window (the config's, as ``WindowKVCache``)."""
        queries = self.offset + mx.arange(n, dtype=mx.int32)
        window = self.window if self.window is not None else window_size
        if window is None:
            return mx.arange(self.capacity, dtype=mx.int32)[None, :] <= queries[:, None]
        held = self.held(self.offset + (n - 1))
        return (held[None, :] >= 0) & (held[None, :] <= queries[:, None]) & (held[None, :] > queries[:, None] - window)

    def held(self, end):
        """Each row's position once a forward has written up to position ``end``: the latest one
        with the row's residue (for a full layer, the row itself while ``end`` < capacity)."""
        return end - (end - mx.arange(self.capacity, dtype=mx.int32)) % self.capacity

    def fit(self, offset: int, width: int, ring: int) -> None:
        """Room for a forward of ``width`` rows at ``offset``: a full layer grows to hold every
        position, a sliding layer to ``ring`` rows (at least ``window - 1 + width``)."""
        need = capacity_for(offset + width)
        size = max(self.capacity, need) if self.window is None else min(ring, need)
        if size != self.capacity:
            if self.keys is not None and self.written > min(self.capacity, size):
                self._relayout(offset, size)
            elif self.keys is not None:  # rows are still positions: pad or cut
                rows = (slice(None), slice(None), slice(0, min(self.capacity, size)))
                pad = [(0, 0), (0, 0), (0, max(0, size - self.capacity)), (0, 0)]
                self.keys, self.values = mx.pad(self.keys[rows], pad), mx.pad(self.values[rows], pad)
            self.capacity = size
        self.written = max(self.written if self.keys is not None else 0, offset + width)

    def _relayout(self, offset: int, size: int) -> None:
        """Move the window before ``offset`` into a ring of ``size`` rows (nothing later: it was
        rejected or never written)."""
        kept = mx.arange(max(0, offset - self.window + 1), offset, dtype=mx.int32)
        keys = mx.zeros((*self.keys.shape[:2], size, self.keys.shape[3]), dtype=self.keys.dtype)
        values = mx.zeros_like(keys)
        keys[:, :, kept % size] = self.keys[:, :, kept % self.capacity]
        values[:, :, kept % size] = self.values[:, :, kept % self.capacity]
        self.keys, self.values = keys, values
        self.written = offset

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def trim(self, n: int) -> int:
        return n  # the target's length is the next offset; later rows are masked or out of reach


def qualifies(caches: list) -> bool:
    """Whether every layer of a target keeps keys/values (full or sliding attention) or a Gated
    DeltaNet state."""
    return bool(caches) and all(type(c) in (KVCache, WindowKVCache, DeltaCache) for c in caches)


def _own(c):
    """The static forward's cache for a layer whose rollback cache (caches.py) is ``c``."""
    if type(c) is DeltaCache:
        return DeltaCache(len(c.cache))
    return StaticKVCache(c.window if isinstance(c, WindowKVCache) else None)


def _arrays(c) -> tuple:
    """What a layer's cache passes through a compiled forward: keys and values, or the conv and
    recurrent states."""
    return (c.keys, c.values) if isinstance(c, StaticKVCache) else (c[0], c[1])


def _install(c, first: mx.array, second: mx.array) -> None:
    if isinstance(c, StaticKVCache):
        c.keys, c.values = first, second
    else:
        c[0], c[1] = first, second


class StaticForward:
    """Forwards of ``model`` over :class:`StaticKVCache` and ``DeltaCache`` layers, compiled per
    (capture, recording, width, capacity) when ``compiled`` (eager otherwise: the prompt's chunks,
    which vary in width).

    A Gated DeltaNet layer's states go in and come out as arrays. A verify forward (``record``)
    also returns, per such layer, its conv input and its state after every position, which
    ``DeltaCache.trim`` rolls back to, as in the eager forward.
    """

    def __init__(self, model: nn.Module, caches: list, finish: Callable[[Capture], tuple], start: Callable) -> None:
        self.model = model
        self.cache = [_own(c) for c in caches]
        self._deltas = [c for c in self.cache if isinstance(c, DeltaCache)]
        self._start, self._finish = start, finish  # the target's hidden-state recorder
        self._compiled: dict[tuple[Capture, bool], Callable] = {}
        sliding = [c.window for c in self.cache if isinstance(c, StaticKVCache) and c.window is not None]
        self._reach = max(sliding) - 1 if sliding else None  # rows before a block its queries see
        self._widest = 1  # the widest compiled forward so far: the rings are sized for it
        self._traced: set[tuple] = set()  # (capture, record, width, buffer rows) traced so far
        self.trace_s = 0.0  # seconds spent tracing and compiling them (a first call returns then)

    def hold(self, width: int) -> None:
        """Size the sliding rings for eager forwards of ``width`` rows from now on (draft trees,
        wider than the compiled blocks), so that chains and trees do not resize them in turn."""
        self._widest = max(self._widest, width)

    def reset(self) -> None:
        """Drop the buffers and states: a short request after a long one should not attend over its rows."""
        for c in self.cache:
            if isinstance(c, StaticKVCache):
                c.keys = c.values = None
                c.capacity = c.written = 0
            else:
                c[0] = c[1] = None
                c.forget()

    def __call__(self, ids: mx.array, offset: int, capture: Capture, compiled: bool = True, record: bool = False):
        """Logits [1, n, vocab] and the captured (features, final) of ``ids`` [1, n] at ``offset``;
        ``record``: keep what rolling its Gated DeltaNet layers back within the block needs."""
        threads.register()
        width = int(ids.shape[1])
        record = record and bool(self._deltas)
        if compiled:
            self._widest = max(self._widest, width)
        # every sliding layer gets the same ring, so one mask serves them all (as the models share it);
        # a prompt chunk widens it and the next compiled forward narrows it back
        ring = 0 if self._reach is None else capacity_for(self._reach + max(width, self._widest))
        sizes = set()
        for c in self.cache:
            if isinstance(c, StaticKVCache):
                c.fit(offset, width, ring)
                sizes.add(c.capacity)
        if record:
            for c in self._deltas:
                c.forget()
        buffers = [a for c in self.cache for a in _arrays(c)]
        first = any(a is None for a in buffers)  # eager: it allocates the buffers and states
        fn = self._compiled_for(capture, record) if compiled and not first else self._eager_for(capture, record)
        key = (capture, record, width, *sorted(sizes))
        tracing, started = compiled and not first and key not in self._traced, time.perf_counter()
        logits, *rest = fn(ids, mx.array(offset, dtype=mx.int32), *([] if first else buffers))
        if tracing:  # a compiled call returns once traced: the arrays are computed later
            self._traced.add(key)
            self.trace_s += time.perf_counter() - started
        captured = int(bool(capture.layer_ids)) + int(capture.final_hidden is not None)
        for i, c in enumerate(self.cache):
            _install(c, rest[captured + 2 * i], rest[captured + 2 * i + 1])
        if record:
            recorded = rest[captured + 2 * len(self.cache):]
            for j, c in enumerate(self._deltas):
                c.conv_input, c.states = recorded[2 * j], recorded[2 * j + 1]
        features = rest[0] if capture.layer_ids else None
        final = rest[captured - 1] if capture.final_hidden is not None else None
        return logits, features, final

    def describe(self) -> str:
        return f"{len(self._traced)} traces in {self.trace_s:.2f} s"

    def _eager_for(self, capture: Capture, record: bool) -> Callable:
        return lambda ids, position, *buffers: self._step(capture, record, ids, position, *buffers)

    def _compiled_for(self, capture: Capture, record: bool) -> Callable:
        fn = self._compiled.get((capture, record))
        if fn is None:
            fn = self._compiled[(capture, record)] = mx.compile(self._eager_for(capture, record))
        return fn

    def _step(self, capture: Capture, record: bool, ids: mx.array, position: mx.array,
              *buffers: mx.array) -> list[mx.array]:
        """[logits, captured arrays.., each layer's two arrays.., (each DeltaNet's conv input and
        states)]: arrays only, as ``mx.compile`` needs."""
        for i, c in enumerate(self.cache):
            if isinstance(c, StaticKVCache):
                c.offset = position
            if buffers:
                _install(c, buffers[2 * i], buffers[2 * i + 1])
        self._start(capture)
        try:
            with recording(self.cache) if record else nullcontext():
                logits = self.model(ids, cache=self.cache)
        except BaseException:
            self._start(Capture())
            raise
        captured = [a for a in self._finish(capture) if a is not None]
        recorded = [a for c in self._deltas for a in (c.conv_input, mx.stack(c.states))] if record else []
        return [logits, *captured, *[a for c in self.cache for a in _arrays(c)], *recorded]


def build(model: nn.Module, caches: list, start: Callable, finish: Callable) -> tuple[StaticForward | None, str]:
    """A checked :class:`StaticForward` for ``model`` (whose rollback caches, ``caches.py``, are
    ``caches``), or None and why not."""
    if not qualifies(caches):
        kinds = sorted({type(c).__name__ for c in caches if type(c) not in (KVCache, WindowKVCache, DeltaCache)})
        return None, f"its layers' caches ({', '.join(kinds)}) are not rolled back by speculant"
    forward = StaticForward(model, caches, finish, start)
    error = check(model, forward)
    if error is not None:
        return None, error
    kinds = {"full-attention": 0, "sliding-window (a ring each)": 0, "Gated DeltaNet": 0}
    for c in forward.cache:
        kinds["Gated DeltaNet" if isinstance(c, DeltaCache) else
              "full-attention" if c.window is None else "sliding-window (a ring each)"] += 1
    return forward, " and ".join(f"{n} {kind}" for kind, n in kinds.items() if n) + " layers over a static cache"


def check(model: nn.Module, forward: StaticForward) -> str | None:
    """Compare a prompt and a compiled block against mlx-lm's own cache; None when they agree."""
    prompt = mx.arange(1, CHECK_ROWS + 1, dtype=mx.int32)[None]
    block = mx.arange(2, 5, dtype=mx.int32)[None]
    kv = [DeltaCache(len(c.cache)) if isinstance(c, DeltaCache) else KVCache() if c.window is None
          else WindowKVCache(c.window) for c in forward.cache]
    try:
        expected = [model(prompt, cache=kv), model(block, cache=kv)]
        got = [forward(prompt, 0, Capture(), compiled=False)[0], forward(block, CHECK_ROWS, Capture(), record=True)[0]]
        mx.eval(expected, got)
    except Exception as error:  # a model whose attention code cannot run over array offsets
        return f"a compiled forward failed: {type(error).__name__}: {error}"
    for want, have in zip(expected, got):
        error = relative_error(want, have)
        if not error <= CHECK_TOLERANCE:
            return f"a compiled forward differed from mlx-lm's cache by {error:.1e} (relative) at load"
    return None
