"""Several sequences' MTP draft steps in one MLX step (issue #39's batched requests).

:class:`RowsCache` stands in the place of one :class:`~speculant.drafters.mtp.mlx_cache.LayerCache`
for a step whose row r belongs to fork r: the attention layout is [rows, heads, 1, d] (one query
per sequence), RoPE starts at each row's own position (``mx.fast.rope`` takes one offset per
batch entry), each row's key and value go into its own fork's cache, and each row's query attends
over that cache alone, padded (:mod:`speculant.drafters.mtp.rows`).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from speculant.drafters.mtp.mlx_cache import LayerCache
from speculant.drafters.mtp.rows import keys_kept


class RowsCache:
    """One MTP layer's caches of several forks, one row (a draft step) each."""

    def __init__(self, caches: Sequence[LayerCache]) -> None:
        self.caches = caches

    @staticmethod
    def heads(x: mx.array) -> mx.array:
        """Rows [rows, heads, d] as [rows, heads, 1, d]: each sequence's one query."""
        return x[:, :, None]

    @staticmethod
    def rows(out: mx.array) -> mx.array:
        return out[:, :, 0]

    def start(self, positions: Sequence[int]) -> mx.array:
        return mx.array(list(positions), dtype=mx.int32)

    def append(self, k: mx.array, v: mx.array, positions: Sequence[int]) -> tuple[mx.array, mx.array]:
        """Row r of k / v [rows, kv_heads, 1, d] into cache r; every row's keys / values, padded."""
        held = [cache.append(k[r:r + 1], v[r:r + 1], [positions[r]]) for r, cache in enumerate(self.caches)]
        n = max(cache.length for cache in self.caches)
        pad = [[(0, 0), (0, 0), (0, n - ck.shape[2]), (0, 0)] for ck, _ in held]
        return (mx.concatenate([mx.pad(ck, p) for (ck, _), p in zip(held, pad)]),
                mx.concatenate([mx.pad(cv, p) for (_, cv), p in zip(held, pad)]))

    def mask(self, positions: Sequence[int]) -> mx.array:
        return mx.array(keys_kept([cache.length for cache in self.caches]))

    def buffers(self) -> list[mx.array]:
        """Every row's key and value buffers (to evaluate with the step)."""
        return [buffer for cache in self.caches for buffer in (cache.k, cache.v)]
