"""The DFlash draft's per-layer cache of context keys/values, shared by the PyTorch and MLX drafts.

Keys and values are arrays ``[..., rows, head_dim]`` (rows on axis -2): ``[kv_heads, n, hd]`` on
PyTorch, ``[1, kv_heads, n, hd]`` on MLX. Each backend passes the one array operation the cache
cannot write with slicing alone: allocating a buffer.
"""

from __future__ import annotations

from typing import Callable, Sequence

from speculant.core.types import Array

FIRST_ROWS = 256  # a compiled draft step's first buffer rows (they double as a request needs)


Allocate = Callable[[Array, int], Array]
"""``allocate(like, rows)``: an uninitialised buffer shaped like ``like`` with ``rows`` rows."""


class ContextCache:
    """Per-layer keys/values of committed context rows, in buffers with room after them: a draft
    writes its block's rows there (never committed) and attends over a view, so no cycle copies
    the context. A sliding layer keeps its last ``window - 1`` rows; its buffer is compacted only
    when full, so that copy is paid once per ``window`` rows, not once per cycle."""

    def __init__(self, windows: Sequence[int | None], allocate: Allocate) -> None:
        n = len(windows)
        self.keys: list[Array | None] = [None] * n
        self.values: list[Array | None] = [None] * n
        self.first = [0] * n  # buffer row of the first kept context row
        self.end = [0] * n  # buffer row after the last committed one
        self.starts: list[int] = [0] * n  # absolute position of the first kept row
        self.windows = list(windows)
        self.allocate = allocate

    def append(self, layer: int, k: Array, v: Array, start: int, reserve: int = 0) -> None:
        """Commit rows ``k``/``v`` (positions ``start ..``); keep room for ``reserve`` block rows
        after them. Rows older than the new ones may be missing (the drafter skips rows no layer
        can see), so the first kept row's position is counted back from the last."""
        n = k.shape[-2]
        self._make_room(layer, n + reserve, k, v)
        end = self.end[layer]
        self.keys[layer][..., end:end + n, :] = k
        self.values[layer][..., end:end + n, :] = v
        self.end[layer] = end + n
        window = self.windows[layer]
        if window is not None and self.length(layer) > window - 1:  # a sliding layer never needs more
            self.first[layer] = self.end[layer] - (window - 1)
        self.starts[layer] = start + n - self.length(layer)

    def _make_room(self, layer: int, rows: int, k: Array, v: Array) -> None:
        keys, first, end = self.keys[layer], self.first[layer], self.end[layer]
        kept = end - first
        if keys is not None and end + rows <= keys.shape[-2]:
            return
        window = self.windows[layer]
        need = kept + rows
        capacity = max(64, 2 * need if window is None else need + window)
        grown_k, grown_v = self.allocate(k, capacity), self.allocate(v, capacity)
        if kept:
            grown_k[..., :kept, :] = keys[..., first:end, :]
            grown_v[..., :kept, :] = self.values[layer][..., first:end, :]
        self.keys[layer], self.values[layer] = grown_k, grown_v
        self.first[layer], self.end[layer] = 0, kept

    def mark(self) -> tuple:
        """The committed state, for :meth:`rewind`. Buffers are never written before ``end``, and a
        grown buffer is a new array, so the state is the pointers and the buffers they index."""
        return list(self.keys), list(self.values), list(self.first), list(self.end), list(self.starts)

    def rewind(self, mark: tuple) -> None:
        """Forget every row committed since :meth:`mark` returned ``mark``."""
        keys, values, first, end, starts = mark
        self.keys, self.values = list(keys), list(values)
        self.first, self.end, self.starts = list(first), list(end), list(starts)

    def length(self, layer: int) -> int:
        return self.end[layer] - self.first[layer]

    def view(self, layer: int) -> tuple[Array, Array]:
        """The kept context keys/values of ``layer`` (a view of its buffers)."""
        first, end = self.first[layer], self.end[layer]
        return self.keys[layer][..., first:end, :], self.values[layer][..., first:end, :]

    def arrays(self) -> list[Array]:
        """Every buffer (MLX schedules their pending writes with a draft)."""
        return [a for a in (*self.keys, *self.values) if a is not None]

    def slot(self, layer: int) -> BlockSlot:
        return BlockSlot(self, layer)


def leave_compiled(net, committed: int) -> None:
    """Move ``net`` off its compiled draft step for good: the context rows that step holds before
    position ``committed`` go into a fresh eager :class:`ContextCache` (later rows were never
    committed). Both backends' compiled steps answer ``context_rows(layer, end)``."""
    compiled, net.compiled = net.compiled, None
    net.reset()
    if committed and compiled.keys:
        for i in range(len(compiled.keys)):
            first, keys, values = compiled.context_rows(i, committed)
            net.cache.append(i, keys, values, first)


class BlockSlot:
    """One layer's context in a :class:`ContextCache`, joined with a block in place."""

    def __init__(self, cache: ContextCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def append(self, k: Array, v: Array, start: int, reserve: int = 0) -> None:
        """Commit context rows (see :meth:`ContextCache.append`)."""
        self.cache.append(self.layer, k, v, start, reserve)

    def join(self, k: Array, v: Array) -> tuple[Array, Array]:
        """Write the block's rows after the context's (in the reserved room, uncommitted) and
        return keys/values over context then block."""
        c, i, n = self.cache, self.layer, k.shape[-2]
        c._make_room(i, n, k, v)  # a no-op when append reserved the room
        first, end = c.first[i], c.end[i]
        c.keys[i][..., end:end + n, :] = k
        c.values[i][..., end:end + n, :] = v
        return c.keys[i][..., first:end + n, :], c.values[i][..., first:end + n, :]
