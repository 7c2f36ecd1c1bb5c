"""Which keys a DFlash block query sees: shared by the PyTorch and MLX drafts."""

from __future__ import annotations


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
