"""What several sequences' MTP draft steps share on every backend (issue #39's batched requests).

A batched draft step runs one MTP layer over one row per sequence: row r is fork r's next draft
step, its query at that fork's own position, its key and value appended to that fork's own cache.
The step lays every row's cached keys / values left-aligned in a zero-padded [rows, kv_heads, N,
hd] buffer (N: the longest cache); :func:`keys_kept` hides the padding. A draft step's single
query comes after every position its cache holds (the drafter crops speculative entries first),
so nothing else is hidden: each row attends exactly as its own one-row step does.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def keys_kept(lengths: Sequence[int]) -> np.ndarray:
    """Boolean keep-mask [rows, 1, 1, N] (every head, the one query) over caches ``lengths`` long,
    padded to N = max(lengths)."""
    lengths = np.asarray(lengths)
    return (np.arange(int(lengths.max()))[None, :] < lengths[:, None])[:, None, None, :]


def active_rows(widths: Sequence[int], step: int) -> list[int]:
    """The rows still drafting at draft step ``step`` (0-based: the token it chooses) of rows drafting ``widths`` tokens."""
    return [r for r, width in enumerate(widths) if width > step]
