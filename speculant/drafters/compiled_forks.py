"""Forks that draft batched rows leave their compiled step until their next request.

A compiled draft step keeps a sequence's state in buffers of its own, which one forward over
several forks cannot read; one eager forward over every row beats a compiled step per row (32
rows of the mid pair on MLX's CPU backend: 0.4 s against 1 s a cycle). So a fork asked to draft
with others hands its state to the eager caches and parks the compiled step, which it takes up
again when its next request starts (a request alone still drafts compiled).
"""

from __future__ import annotations

from typing import Any, Callable


def park(drafter: Any, leave: Callable[[], None]) -> None:
    """Move ``drafter.net`` off its compiled step, if on one; ``leave()`` sets ``net.compiled`` to
    None and moves the step's state into the eager caches."""
    compiled = getattr(drafter.net, "compiled", None)
    if compiled is not None:
        leave()
        if drafter.net.compiled is None:
            drafter.parked = compiled


def resume(drafter: Any) -> None:
    """A new request: back on the parked compiled step (its buffers are reset with the caches)."""
    if drafter.parked is not None:
        drafter.net.compiled, drafter.parked = drafter.parked, None


def fork_parked(parent: Any, child: Any) -> None:
    """``child``, just forked from ``parent``: on buffers of its own of the parked step, if any."""
    if parent.parked is not None:
        child.net.compiled = parent.parked.fork()
        child.net.reset()
    child.parked = None
