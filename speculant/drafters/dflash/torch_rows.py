"""Several sequences' DFlash blocks in one PyTorch draft forward (issue #39's batched requests).

Each sequence keeps its own :class:`~speculant.drafters.dflash.context.ContextCache` (its fork's
network); the forward stacks the blocks [rows, q, H] and, per layer, lays every row's context
keys/values left-aligned in a zero-padded [rows, kv_heads, N + q, hd] buffer with its block after
them. :func:`speculant.drafters.dflash.visibility.rows_keep` hides the padding, what each row's
own causal/window rules hide, and the block rows past a narrower row's width, so every row
attends exactly as its own forward would.
"""

from __future__ import annotations

from typing import Sequence

import torch

from speculant.drafters.dflash.context import ContextCache
from speculant.drafters.dflash.torch import take_in_rows
from speculant.drafters.dflash.visibility import caches_keep


class PaddedRows:
    """One layer's context of every row, joined with the rows' blocks ([rows, kv_heads, n, hd])."""

    def __init__(self, caches: Sequence[ContextCache], layer: int) -> None:
        self.caches, self.layer = caches, layer
        self.length = max(c.length(layer) for c in caches)

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, q, hd = k.shape
        n = self.length
        keys, values = k.new_zeros(rows, heads, n + q, hd), v.new_zeros(rows, heads, n + q, hd)
        for r, cache in enumerate(self.caches):
            ck, cv = cache.view(self.layer)
            keys[r, :, :ck.shape[-2]] = ck
            values[r, :, :cv.shape[-2]] = cv
        keys[:, :, n:], values[:, :, n:] = k, v
        return keys, values

    def mask(self, positions: Sequence[int], widths: Sequence[int], q: int, causal: bool, window, device) -> torch.Tensor:
        """The keep-mask [rows, 1, q, N + q] (shared by every head)."""
        keep = caches_keep(self.caches, self.layer, positions, widths, q, causal, window)
        return torch.from_numpy(keep).to(device)[:, None]


@torch.inference_mode()
def hidden_rows(nets: Sequence, contexts: Sequence[tuple[torch.Tensor, int]], block_ids: Sequence[Sequence[int]],
                positions: Sequence[int], widths: Sequence[int]) -> torch.Tensor:
    """Final-normed rows 1.. of every row's block ([rows, q - 1, H]): ``nets[r]`` (eager
    ``TorchDFlashNetwork`` forks over one model) takes in ``contexts[r]`` (new feature rows and
    the position of the first) and drafts ``block_ids[r]`` at ``positions[r]``; rows past
    ``widths[r] + 1`` are filler, cut by the caller."""
    net = nets[0]
    m, dtype = net.model, net._dtype
    device = next(m.parameters()).device
    block_ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    rows, q = block_ids.shape
    take_in_rows(nets, contexts, reserve=0)
    x = net.target.embed(block_ids.reshape(-1), raw=True).to(dtype).view(rows, q, -1)
    if net.cfg.input_embedding_scale != 1.0:
        x = x * net.cfg.input_embedding_scale
    spans = [m.rotary.span(p, q, dtype, device) for p in positions]
    cos = torch.stack([c for c, _ in spans])[:, None]  # [rows, 1, q, hd]: every head alike
    sin = torch.stack([s for _, s in spans])[:, None]
    caches = [each.cache for each in nets]
    for i, layer in enumerate(m.layers):
        context = PaddedRows(caches, i)
        x = layer(x, cos, sin, context, context.mask(positions, widths, q, layer.causal, layer.window, device))
    return m.norm(x[:, 1:])
