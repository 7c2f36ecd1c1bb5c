"""Which keys a DFlash block query sees: shared by the PyTorch and MLX drafts."""

from __future__ import annotations

import numpy as np


def keep_by_distance(keep, rel, causal: bool, window: int | None):
    """``keep`` narrowed to the keys a query sees, from ``rel`` = query - key positions (torch or mlx
    arrays alike): causal layers see no later key, a window hides keys ``window`` or more away."""
    if causal:
        keep = keep & (rel >= 0)
    if window is not None:
        keep = keep & (rel < window)
        if not causal:
            keep = keep & (rel > -window)
    return keep


def every_key_visible(ctx_start: int, block_start: int, block_length: int, causal: bool, window: int | None) -> bool:
    """True when a block at ``block_start ..`` sees every context row from ``ctx_start`` on and
    every block row, so no mask is needed. Context rows precede the block, so a non-causal
    layer hides a key only when it lies ``window`` or more positions away from a query."""
    if causal:
        return False
    return window is None or (block_start + block_length - 1 - ctx_start < window and block_length <= window)


def rows_keep(ctx_starts, ctx_lengths, positions, widths, q_len: int, causal: bool, window: int | None) -> np.ndarray:
    """Boolean keep-mask [rows, q_len, N + q_len] for several sequences' blocks drafted in one forward.

    Row ``r`` holds its own context keys (positions ``ctx_starts[r] ..``, ``ctx_lengths[r]`` of
    them) left-aligned in N = max(ctx_lengths) slots, the rest padding, then its block (queries
    and keys at ``positions[r] ..``). A row drafting ``widths[r]`` tokens sees only block rows
    ``0 .. widths[r]``, so it attends as its own narrower block would; the rows past that are cut
    from its draft, but each still sees itself, so no query is left with no key (NaN)."""
    starts, lengths = np.asarray(ctx_starts)[:, None], np.asarray(ctx_lengths)[:, None]
    positions, widths = np.asarray(positions)[:, None], np.asarray(widths)[:, None]
    n, j = int(lengths.max()), np.arange(q_len)
    queries = positions + j  # [R, q]
    keys = np.concatenate([starts + np.arange(n), queries], axis=1)  # [R, N + q]
    present = np.concatenate([np.arange(n) < lengths, j <= widths], axis=1)
    rel = queries[:, :, None] - keys[:, None, :]  # query - key
    keep = keep_by_distance(np.broadcast_to(present[:, None, :], rel.shape).copy(), rel, causal, window)
    keep[:, j, n + j] = True
    return keep


def caches_keep(caches, layer: int, positions, widths, q_len: int, causal: bool, window: int | None) -> np.ndarray:
    """:func:`rows_keep` for layer ``layer`` of several rows' ``ContextCache`` s."""
    return rows_keep([c.starts[layer] for c in caches], [c.length(layer) for c in caches],
                     positions, widths, q_len, causal, window)
