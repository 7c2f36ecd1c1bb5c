"""A sampled draft's own chain inside its tree, verified by speculative sampling (exact).

A drafter that samples its chain (DFlash2 at temperature > 0: each token drawn from its q row)
gives the chain verifier speculative sampling's coupling: x_t is accepted with min(1, p/q), and a
rejection draws from the residual max(0, p - q). Sample and match gives a tree no such coupling:
a node descends only where the target's own draw is one of its children, so a tree that holds the
sampled chain can still accept less than that chain did. Here the tree keeps the sampled chain as
one of its paths and verifies each of the chain's nodes by speculative sampling: x accepted with
min(1, p/q), else the residual's draw, which descends when it is another child of the node. Every
other node keeps sample and match. The walk then accepts at least what the chain would with the
same uniforms (``chain_accepted`` reports that count, so trees and chains pair under sampling too).

**Exact**: at every node the emitted token is a draw from the target's distribution given the
path (speculative sampling's output law, or the target's own draw), provided that x_{d+1}, the
chain's token below its node at depth d, is still distributed as q given whatever decided that
the walk reached that node. So the tree down to depth d may depend on x_1..x_d only, never on a
later draw: the number of nodes at each depth is fixed first, from the tree built without the
chain (:func:`depth_counts`), and each depth is then filled with the chain's node and the most
probable others under the nodes kept above (:func:`with_sampled_path`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from speculant.core.arrays import Array, ArrayOps
from speculant.core.sampling import inverse_cdf
from speculant.core.tree import DraftTree
from speculant.core.types import Draft
from speculant.verifiers.acceptance import accept_draft, draft_rows, residual

if TYPE_CHECKING:
    from speculant.verifiers.tree import Children


@dataclass(frozen=True)
class SampledPath:
    """The draft's sampled chain and its tree: ``tokens`` the drafted tokens; ``nodes`` the anchor's
    node (0) and then the nodes of the chain's first tokens the tree holds, in order; ``draft`` the
    proposal whose q rows the tokens were drawn from. Every one of those nodes tests the chain's
    token below it, also one the tree left out (accepted, it is emitted and the walk stops):
    whether a test happens must not depend on the token tested, or the node's output would not be
    the target's law."""

    tokens: tuple[int, ...]
    nodes: tuple[int, ...]
    draft: Draft
    whole: bool  # the tree holds the whole chain on every draft (not only where it ranks in)

    @property
    def tested(self) -> int:
        """Chain tokens tested: one below each of the chain's nodes in the tree."""
        return min(len(self.tokens), len(self.nodes))


def depth_counts(tree: DraftTree, path_length: int, budget: int) -> list[int]:
    """Nodes per depth (depth 1 first) for a tree of ``budget`` drafted nodes that must hold a
    chain of ``path_length`` (<= budget): the depths of ``tree`` (built without the chain), at
    least one at each of the chain's depths, and the most crowded depth (the deeper on a tie)
    giving nodes back until the total is the budget."""
    counts = [0] * max(max(tree.depths), path_length)
    for depth in tree.depths[1:]:
        counts[depth - 1] += 1
    for d in range(path_length):
        counts[d] = max(counts[d], 1)
    while sum(counts) > budget:
        spare = [d for d in range(len(counts)) if counts[d] > (1 if d < path_length else 0)]
        counts[max(spare, key=lambda d: (counts[d], d))] -= 1
    while counts and counts[-1] == 0:
        counts.pop()
    return counts


def with_sampled_path(anchor_id: int, counts: Sequence[int], children: "Children", ranked: "Children",
                      path: Sequence[int], bonus: float = math.inf) -> tuple[DraftTree, tuple[int, ...]]:
    """Depth by depth, ``counts[d]`` nodes at depth d + 1: the chain's node (``path[d]`` under the
    chain's node above) and the most probable other children (``children``: a parent's candidates
    in a row, most probable first) of the nodes kept above. The chain's node is kept while its
    log-probability plus ``bonus`` reaches that of the depth's last node kept otherwise (with
    ``bonus`` inf: always); where it is not, the chain ends there. ``ranked`` (a row's candidates,
    the chain's tokens among them) scores a chain token that ``children`` leaves out; one that it
    does not list either comes last and gets no children. Returns the tree and the
    chain's nodes (the root first); within a depth, nodes are in order of score (a parent's first
    child is its most probable)."""
    tokens, parents = [anchor_id], [-1]
    frontier = [(0.0, 0, -1)]  # (path log-probability, node, state) of the nodes at this depth
    chain = [0]
    for row, want in enumerate(counts):
        options = []  # (-score, parent's order, rank, parent node, token, state)
        for order, (score, node, state) in enumerate(frontier):
            if state is None:
                continue
            for rank, (token, logprob, child_state) in enumerate(children(row, state)):
                options.append((-(score + logprob), order, rank, node, token, child_state))
        options.sort()
        forced = None
        if row < len(path) and len(chain) == row + 1:
            forced = _chain_option(options, frontier, chain[-1], row, path, ranked)
            others = [o for o in options if o is not forced]
            if want == 0 or (len(others) >= want and forced[0] - bonus > others[want - 1][0]):
                forced = None
        kept = [o for o in options if o is not forced][: want - (forced is not None)]
        level = sorted(kept + ([forced] if forced is not None else []))
        frontier = []
        for option in level:
            node = len(tokens)
            tokens.append(option[4])
            parents.append(option[3])
            frontier.append((-option[0], node, option[5]))
            if option is forced:
                chain.append(node)
    return DraftTree(tuple(tokens), tuple(parents)), tuple(chain)


def _chain_option(options: list, frontier: list, parent: int, row: int, path: Sequence[int], ranked: "Children"):
    token = int(path[row])
    found = next((o for o in options if o[3] == parent and o[4] == token), None)
    if found is not None:
        return found
    score, state = next((s, st) for s, n, st in frontier if n == parent)
    listed = ranked(row, state)
    hit = next(((lp, st) for t, lp, st in listed if t == token), None)
    if hit is None:  # not a candidate the ranking knows: last, with no children
        hit = (-math.inf, None)
    return (-(score + hit[0]), -1, -1, parent, token, hit[1])


def coupled_parts(ops: ArrayOps, probs: Array, sampled: SampledPath, u_nodes) -> list[Array]:
    """What the walk needs at the chain's nodes, for the cycle's one transfer: per tested token x_j
    (drawn below chain node j - 1), the residual's draw at that node (the node's own uniform),
    p(x_j) and q(x_j)."""
    m, vocab = sampled.tested, int(probs.shape[-1])
    draft = sampled.draft
    p_rows = ops.concatenate([probs[n : n + 1] for n in sampled.nodes[:m]])
    ids = draft.token_ids[:m]
    x = ops.concatenate([ids, ids[-1:]])
    q_probs = draft.draft_probs[:m][None]
    q_ids = None if draft.candidate_ids is None else draft.candidate_ids[:m][None]
    q_full = draft_rows(ops, x, q_probs, q_ids, (1, m, vocab))[:m]
    left = residual(ops, p_rows, q_full)
    mass = ops.sum(left, keepdims=True)
    left = ops.where((mass > 0.0) & (mass < math.inf), left, p_rows)
    u = ops.asarray([[float(u_nodes[n])] for n in sampled.nodes[:m]])
    return [inverse_cdf(ops, left, u), ops.gather(p_rows, x[:m, None])[:, 0], ops.gather(q_full, x[:m, None])[:, 0]]


@dataclass
class ChainTests:
    """The chain's tests on the host after the transfer: per tested token, the residual's draw at
    its parent node, p(x), q(x), and the acceptance uniform."""

    sampled: SampledPath
    residual_picks: list[float]
    target_x: list[float]
    draft_x: list[float]
    u: Sequence[float]

    def __post_init__(self) -> None:
        self.index = {n: j for j, n in enumerate(self.sampled.nodes[: self.sampled.tested])}

    def passes(self, j: int) -> bool:
        return accept_draft(self.target_x[j], self.draft_x[j], self.u[j])

    def step(self, node: int) -> tuple[int | None, int | None]:
        """At ``node``: (the chain's child, None) when its token is accepted and in the tree;
        (None, the token the node emits) when it is accepted but not in the tree, or rejected (the
        residual's draw); (None, None) off the chain."""
        j = self.index.get(node)
        if j is None:
            return None, None
        if not self.passes(j):
            return None, int(self.residual_picks[j])
        nodes = self.sampled.nodes
        return (nodes[j + 1], None) if j + 1 < len(nodes) else (None, self.sampled.tokens[j])

    def accepted(self) -> int:
        """How many of the tested tokens speculative sampling accepts with these uniforms."""
        m = self.sampled.tested
        return next((j for j in range(m) if not self.passes(j)), m)
