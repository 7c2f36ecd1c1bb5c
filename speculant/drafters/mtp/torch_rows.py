"""Several sequences' MTP draft steps in one PyTorch step (issue #39's batched requests).

:class:`RowsCache` stands in the place of one :class:`~speculant.drafters.mtp.torch.LayerCache`
for a step whose row r belongs to fork r: each row's key and value go into its own fork's cache,
and each row's query attends over that cache alone, padded (:mod:`speculant.drafters.mtp.rows`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculant.drafters.mtp.rows import keys_kept
from speculant.drafters.mtp.torch import LayerCache, attention


class RowsCache:
    """One MTP layer's caches of several forks, one row (a draft step) each."""

    def __init__(self, caches: Sequence[LayerCache]) -> None:
        self.caches = caches

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
        """Appends row r of k / v [kv_heads, rows, d] to cache r; row r of q [heads, rows, d]
        attends over cache r; returns [rows, heads, dv], as ``LayerCache.attend``."""
        held = [cache.append(k[:, r:r + 1], v[:, r:r + 1], positions[r:r + 1])[:2] for r, cache in enumerate(self.caches)]
        lengths = [cache.length for cache in self.caches]
        rows, n = len(held), max(lengths)
        keys = k.new_zeros(rows, k.shape[0], n, k.shape[2])
        values = v.new_zeros(rows, v.shape[0], n, v.shape[2])
        for r, (ck, cv) in enumerate(held):
            keys[r, :, :ck.shape[1]], values[r, :, :cv.shape[1]] = ck, cv
        keep = torch.from_numpy(keys_kept(lengths)).to(q.device)
        return attention(q.transpose(0, 1)[:, :, None], keys, values, keep, scale)[:, :, 0]
