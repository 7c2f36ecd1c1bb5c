"""Tree verify forwards over a PyTorch target's :class:`RollbackCache` (docs/tree-verification.md).

One forward runs every node of a draft tree after the cache: positions ``cache + depth`` and a
custom additive 4-D mask per attention kind (the model uses a ready 4-D mask as it is). A node
sees the cached rows a chain token at its position would see (all of them under full attention;
under sliding attention those less than ``window`` positions back) and, among the tree's rows,
only its ancestors and itself. The commit then keeps, in every attention layer, the cached rows
plus the accepted path's rows in path order, exactly the rows a chain over that path would have
written. Gated DeltaNet layers (a recurrent state per sequence, not per node) take no tree here.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from speculant.core.tree import DraftTree, kept_rows


def tree_mask(cache, tree: DraftTree, dtype: torch.dtype, device: torch.device):
    """The additive mask ``[1, 1, T, visible cached rows + T]`` for every attention kind in ``cache``:
    one tensor when all layers are of one kind, else a dict by ``layer_types`` name."""
    masks = {}
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            raise ValueError("a Gated DeltaNet layer takes no tree (see TorchBackend.tree_problem)")
        sliding = isinstance(layer, DynamicSlidingWindowLayer)
        kind = "sliding_attention" if sliding else "full_attention"
        if kind in masks:
            continue
        cached = int(layer.keys.shape[-2]) if layer.is_initialized else 0
        allowed = torch.as_tensor(tree.visibility(cached, layer.sliding_window if sliding else None), device=device)
        zero = torch.zeros((), dtype=dtype, device=device)
        masks[kind] = torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


@torch.inference_mode()
def commit_path(cache, tree: DraftTree, path: Sequence[int]) -> None:
    """Keep, in every layer, the rows before the tree's rows and the rows of the nodes ``path``."""
    width = tree.size
    rows = kept_rows(tree, path)
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        kept = int(layer.keys.shape[-2]) - width  # the cached rows before the tree's
        index = torch.as_tensor(rows, device=layer.keys.device) + kept
        layer.keys = torch.cat([layer.keys[:, :, :kept], layer.keys.index_select(2, index)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :kept], layer.values.index_select(2, index)], dim=2)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length -= width - len(rows)
    cache.rollback(0)  # sliding buffers back to window - 1 rows; the block is closed
