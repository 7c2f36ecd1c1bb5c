"""The eager MLX MTP layer's KV cache, and the attention layout of one sequence's rows.

An attention module asks its cache how to lay out heads (:meth:`SequenceRows.heads`) and read the
output back (:meth:`SequenceRows.rows`), where RoPE starts (``start``) and what each query sees
(``mask``): one sequence's n rows here and in the compiled step's traced buffers; one row of each
of several sequences in :class:`speculant.drafters.mtp.mlx_rows.RowsCache`.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np


class SequenceRows:
    """The attention layout [1, heads, n, d] of one sequence's n rows."""

    @staticmethod
    def heads(x: mx.array) -> mx.array:
        """Rows [n, heads, d] in the attention layout."""
        return x.transpose(1, 0, 2)[None]

    @staticmethod
    def rows(out: mx.array) -> mx.array:
        """The attention output back as rows [n, heads, dv]."""
        return out[0].transpose(1, 0, 2)


class LayerCache(SequenceRows):
    """Keys/values [1, kv_heads, length, hd] in a buffer grown in steps, positions on the host."""

    step = 256

    def __init__(self) -> None:
        self.k: mx.array | None = None
        self.v: mx.array | None = None
        self.positions: list[int] = []

    @property
    def length(self) -> int:
        return len(self.positions)

    def append(self, k: mx.array, v: mx.array, positions: Sequence[int]):
        start, n = self.length, k.shape[2]
        need = start + n
        if self.k is None or need > self.k.shape[2]:
            cap = ((need + self.step - 1) // self.step) * self.step
            grown_k = mx.zeros((1, k.shape[1], cap, k.shape[3]), dtype=k.dtype)
            grown_v = mx.zeros((1, v.shape[1], cap, v.shape[3]), dtype=v.dtype)
            if start:
                grown_k[:, :, :start] = self.k[:, :, :start]
                grown_v[:, :, :start] = self.v[:, :, :start]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, start:need] = k
        self.v[:, :, start:need] = v
        self.positions.extend(int(p) for p in positions)
        return self.k[:, :, :need], self.v[:, :, :need]

    def start(self, positions: Sequence[int]) -> int:
        """The first position of the rows being run (their RoPE offset)."""
        return positions[0]

    def mask(self, positions: Sequence[int]) -> mx.array | None:
        """Causal keep-mask of ``positions`` over the cached rows; None for one row (it comes after every one)."""
        if len(positions) == 1:
            return None
        return mx.array(np.asarray(self.positions)[None, :] <= np.asarray(positions)[:, None])

    def crop(self, length: int) -> None:
        del self.positions[length:]
