"""Row counts of the preallocated buffers compiled steps attend over, shared by every backend.

A compiled step is traced once per buffer size and attends over every row of its buffers, so the
sizes trade re-tracing against unused rows: a multiple of :data:`STEP`, or of an eighth of the
power of two below the rows needed, keeps at most about 1/8 of the rows unused and traces a long
request once per eighth of each doubling (under 60 sizes up to 4096 rows).
"""

from __future__ import annotations

STEP = 32  # the smallest step by which buffers grow
FAR = -(1 << 30)  # the position recorded for a buffer row never written (masked: positions are >= 0)


def capacity_for(rows: int) -> int:
    """Buffer rows for ``rows`` rows."""
    step = max(STEP, (1 << (max(rows, 1).bit_length() - 1)) // 8)
    return -(-rows // step) * step


def padded(n: int) -> int:
    """``n`` rounded up to a power of two: the row bucket of a compiled step."""
    return 1 << (n - 1).bit_length()
