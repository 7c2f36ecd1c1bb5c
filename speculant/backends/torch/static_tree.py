"""Draft trees over the compiled path's static cache (compiled.py; docs/tree-verification.md).

The static cache keeps row ``r`` at position ``r`` in every attention layer (sliding layers
included, laid out as full ones), so a tree forward writes its ``T`` nodes at rows ``start ..
start + T`` like a chain block and needs only its own mask and positions:

- **Mask** ``[1, 1, padded, rows]`` per attention kind: node ``i`` sees the cached rows a chain
  token at its position would see (under a sliding window, those fewer than ``window`` positions
  back) and, among the tree's rows, its ancestors and itself. A compiled graph may run more rows
  than the tree has nodes (``padded``: its budget's graph, compiled.py ``tree_width``); each
  padding row sees only itself, its outputs are dropped, and the next forward overwrites what it
  wrote.
- **Commit**: the accepted path's rows are copied, in path order, to rows ``start ..`` in place
  (the graphs read the buffers at fixed addresses), and the write position moves to the path's end.

Gated DeltaNet layers (recording_static.py) record their inputs and the recurrent state after
each row of a forward. A tree's forward runs eagerly (the delta rule reads each node's parent
outside a graph, rollback.py), each node from its parent's state and its convolution over its
ancestors (tree.py), so the record holds every node's; the commit installs the path's last
node's state and the convolution window of the cached inputs then the path's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from speculant.backends.torch.rollback import RollbackCache
from speculant.backends.torch.tree import additive_mask, attention_kind
from speculant.core.tree import DraftTree, kept_rows

def attention_windows(config) -> dict[str, int | None]:
    """Each attention kind among ``config``'s layers and its sliding window (None: full), as the
    eager cache lays them out (the model masks each kind by the same config)."""
    windows: dict[str, int | None] = {}
    for layer in RollbackCache(config=config).layers:
        kind, window = attention_kind(layer)
        if kind is not None:
            windows.setdefault(kind, window)
    return windows


def tree_inputs(windows: dict[str, int | None], tree: DraftTree, start: int, rows: int,
                dtype: torch.dtype, device: torch.device):
    """``inputs(padded)``: the mask and positions of ``tree`` written at row ``start`` of a static
    cache of ``rows`` rows, for a forward of ``padded`` >= ``tree.size`` rows."""
    def inputs(padded: int) -> dict:
        pad = np.arange(tree.size, padded)
        masks = {}
        for kind, window in windows.items():
            allowed = np.zeros((padded, rows), dtype=bool)
            allowed[: tree.size, : start + tree.size] = tree.visibility(start, window)
            allowed[pad, start + pad] = True
            masks[kind] = additive_mask(allowed, dtype, device)
        positions = tree.positions(start)
        positions += [positions[-1]] * len(pad)  # padding rows: any position, their outputs are dropped
        mask = next(iter(masks.values())) if len(masks) == 1 else masks
        return {"attention_mask": mask, "position_ids": torch.tensor([positions], device=device)}

    return inputs


@torch.inference_mode()
def commit_static_path(static, start: int, tree: DraftTree, path: Sequence[int]) -> None:
    """Keep the rows before ``start`` and the accepted ``path``'s rows after them, in path order."""
    rows = kept_rows(tree, path)
    if rows != list(range(len(rows))):  # a path of first rows is in place already
        for layer in static.cache.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            index = torch.as_tensor(rows, device=layer.keys.device) + start
            for buffer in (layer.keys, layer.values):
                buffer[:, :, start : start + len(rows)] = buffer.index_select(2, index)
    if static.hybrid:
        static.cache.keep_path(rows)
        static.recorded = (start + len(rows), 0)  # the record was the tree's: nothing before this is undone
    static.set_length(start + len(rows))
