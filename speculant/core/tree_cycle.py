"""One tree cycle of a request's loop (the ``tree`` verifier; docs/tree-verification.md).

The drafter's block gives a distribution per position; the verifier builds a tree of the most
probable prefixes; the target runs every node in one forward (ancestor-only visibility) and keeps
the rows of the accepted path; the drafter commits those rows, as if that path had been a chain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculant.core.types import CycleTiming, DraftSource, ForwardOutput

if TYPE_CHECKING:
    from speculant.core.engine import Engine
    from speculant.core.loop import Loop, Proposal


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


def tree_cycle(loop: "Loop", proposal: "Proposal") -> list[int]:
    """Verify ``proposal``'s tree in one target forward, commit the accepted path, emit its tokens."""
    e, position = loop.e, loop.position
    out, target_s = loop._timed(lambda: e.target.forward_tree(proposal.tree, loop.capture), "target_s")
    new, path = accept_tree(loop, proposal, out, target_s)
    e.target.commit_tree(position, path)
    return new


def accept_tree(loop: "Loop", proposal: "Proposal", out: ForwardOutput, target_s: float) -> tuple[list[int], list[int]]:
    """Take the target's forward ``out`` over ``proposal``'s tree (its own rows, node order): the
    tokens emitted and the accepted path (node indices, root first), whose rows the caller keeps in
    the target's caches; the drafter and the prefix store take those rows as a chain's."""
    e, tree, position = loop.e, proposal.tree, loop.position
    verification = loop.verifier.verify_tree(e.backend.ops, tree, out.logits, loop.sampling, loop.verify_rng)
    path, rows = path_rows(out, e.backend.int_array(verification.path)), len(verification.path)
    loop.prefix.committed(path, rows)  # the rows the caches keep, as a chain's first rows
    commit_s = 0.0
    if loop.speculating:
        _, commit_s = loop._timed(lambda: loop.drafter.commit(path, rows, verification.token_ids), "draft_s")
    loop.verifier.observe(verification, tree.num_drafted, CycleTiming(
        position, tree.num_drafted, proposal.drafted, target_s, proposal.draft_s, commit_s, DraftSource.MODEL))
    new = loop._emit(verification.token_ids)
    loop.stats.record_cycle(max(tree.depths), verification.accepted, len(new))
    loop.position += len(new)
    return new, list(verification.path)


def path_rows(out: ForwardOutput, rows) -> ForwardOutput:
    """The forward's rows of the accepted path's nodes, in path order (what a chain would give)."""
    def take(x):
        return None if x is None else x[rows]

    return ForwardOutput(logits=take(out.logits), features=take(out.features), final_hidden=take(out.final_hidden))
