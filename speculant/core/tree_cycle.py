"""One tree cycle of a request's loop (the ``tree`` verifier; docs/tree-verification.md).

The drafter's block gives a distribution per position; the verifier builds a tree of the most
probable prefixes; the target runs every node in one forward (ancestor-only visibility) and keeps
the rows of the accepted path; the drafter commits those rows, as if that path had been a chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculant.core.tree import DraftTree
from speculant.core.types import CycleTiming, DraftSource, ForwardOutput

if TYPE_CHECKING:
    from speculant.core.engine import Engine
    from speculant.core.loop import Loop


def trees_allowed(engine: "Engine") -> bool:
    """Whether this request may verify trees: the verifier builds them and the target takes them.
    A target that cannot is reported to the verifier, which then verifies chains and says why."""
    if not engine.verifier.builds_trees:
        return False
    problem = engine.target.tree_problem()
    if problem is not None:
        engine.verifier.tree_refused(problem)
        return False
    return True


def tree_cycle(loop: "Loop", position: int, tree: DraftTree, drafted: int, draft_s: float) -> list[int]:
    """Verify ``tree`` in one target forward, commit the accepted path, emit its tokens."""
    e = loop.e
    out, target_s = loop._timed(lambda: e.target.forward_tree(tree, loop.capture), "target_s")
    verification = loop.verifier.verify_tree(e.backend.ops, tree, out.logits, loop.sampling, loop.verify_rng)
    e.target.commit_tree(position, verification.path)
    commit_s = 0.0
    if loop.speculating:
        path = path_rows(out, e.backend.int_array(verification.path))
        rows = len(verification.path)
        _, commit_s = loop._timed(lambda: loop.drafter.commit(path, rows, verification.token_ids), "draft_s")
    depth = max(tree.depths)
    loop.verifier.observe(verification, tree.num_drafted,
                       CycleTiming(position, tree.num_drafted, drafted, target_s, draft_s, commit_s, DraftSource.MODEL))
    new = loop._emit(verification.token_ids)
    loop.stats.record_cycle(depth, verification.accepted, len(new))
    return new


def path_rows(out: ForwardOutput, rows) -> ForwardOutput:
    """The forward's rows of the accepted path's nodes, in path order (what a chain would give)."""
    def take(x):
        return None if x is None else x[rows]

    return ForwardOutput(logits=take(out.logits), features=take(out.features), final_hidden=take(out.final_hidden))
