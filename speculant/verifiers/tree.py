"""Tree verification (DDTree, arXiv 2604.12989), written once over ArrayOps.

**Building.** A block drafter gives one distribution per block position q_1..q_L (marginals,
not conditioned on the path). The tree keeps the ``budget`` most probable prefixes under
Q(y) = prod q_d(y_d): a best-first heap over path log-probabilities on rank tuples, seeded with
rank 0 at depth 1; each pop adds a node and pushes its next sibling and its first child. Only the
``width`` most probable tokens per depth can appear (:func:`top_candidates`).

**Verifying: sample and match.** The target picks a token at *every* node (its argmax at
temperature 0, a draw from its processed distribution otherwise); from the root the walk descends
while the node's pick is one of its children; the pick where it stops is the bonus token. Every
emitted token is a draw from the target's distribution given the tokens before it, so this is
exact however the tree was built. (The chain rule min(1, p/q) is not: the top-k children are not
samples from q, and accepting them with p/q over-accepts; tests/test_tree.py shows a chi-square
test rejecting it.) Uniforms: one per node per sampled cycle, whatever the outcome.
"""

from __future__ import annotations

import heapq
import math
from functools import partial
from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.sampling import inverse_cdf, target_probs
from speculant.core.tree import DraftTree, with_branch
from speculant.core.types import Draft, SamplingParams, Verification
from speculant.verifiers.acceptance import _raise_non_finite, fetch, verify_rows


def top_candidates(ops: ArrayOps, logits: Array, width: int) -> tuple[list[list[int]], list[list[float]]]:
    """Per row of ``logits`` [L, V], the ``width`` most probable tokens (ties: lowest id first) and
    their log-probabilities, most probable first; one device-to-host transfer."""
    scores = ops.log_softmax(ops.float32(logits))
    rows, vocab = int(scores.shape[0]), int(scores.shape[-1])
    width = max(1, min(width, vocab))
    ids, values = [], []
    for _ in range(width):  # repeated argmax: ArrayOps has no top-k, and the width is small
        best = ops.argmax(scores)[:, None]
        ids.append(best[:, 0])
        values.append(ops.gather(scores, best)[:, 0])
        scores = ops.scatter_add(scores, best, ops.full((rows, 1), -math.inf))
    host = fetch(ops, ids + values)
    per_rank = [host[j * rows:(j + 1) * rows] for j in range(2 * width)]
    top_ids = [[int(per_rank[j][r]) for j in range(width)] for r in range(rows)]
    top_logprobs = [[per_rank[width + j][r] for j in range(width)] for r in range(rows)]
    return top_ids, top_logprobs


def build_tree(anchor_id: int, top_ids: list[list[int]], top_logprobs: list[list[float]], budget: int) -> DraftTree:
    """The ``budget`` most probable prefixes (root not counted) of the per-depth candidates,
    in the order the heap pops them (every parent before its children)."""
    tokens, parents = [anchor_id], [-1]
    if not top_ids or budget <= 0:
        return DraftTree(tuple(tokens), tuple(parents))
    # entries: (-path log-prob, rank tuple, parent node); the rank tuple breaks ties deterministically
    heap: list[tuple[float, tuple[int, ...], int]] = [(-top_logprobs[0][0], (0,), 0)]
    while heap and len(tokens) - 1 < budget:
        negative, ranks, parent = heapq.heappop(heap)
        if negative == math.inf:
            break  # only zero-probability prefixes are left
        depth, rank, score = len(ranks) - 1, ranks[-1], -negative
        node = len(tokens)
        tokens.append(top_ids[depth][rank])
        parents.append(parent)
        if rank + 1 < len(top_ids[depth]):
            sibling = score - top_logprobs[depth][rank] + top_logprobs[depth][rank + 1]
            heapq.heappush(heap, (-sibling, ranks[:-1] + (rank + 1,), parent))
        if depth + 1 < len(top_ids):
            heapq.heappush(heap, (-(score + top_logprobs[depth + 1][0]), ranks + (0,), node))
    return DraftTree(tuple(tokens), tuple(parents))


def draft_tree(ops: ArrayOps, draft: Draft, anchor_id: int, budget: int, width: int) -> tuple[DraftTree, list[int]]:
    """The tree of ``draft``'s per-position distributions (``draft.logits``, which must be set),
    with its prompt-lookup copy (``draft.branch_ids``) as one more path; and the nodes only the
    copy proposed (beyond the budget)."""
    top_ids, top_logprobs = top_candidates(ops, draft.logits[: draft.num_tokens], width)
    tree = build_tree(anchor_id, top_ids, top_logprobs, budget)
    return with_branch(tree, draft.branch_ids) if draft.branch_ids else (tree, [])


def tree_verify(
    ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams, rng: Any
) -> Verification:
    """Sample and match over ``tree`` with the target's logits at every node ([T, V], node order).

    ``Verification.path`` holds the nodes of the anchor and the accepted drafts."""
    rows = verify_rows(target_logits, tree.size - 1)
    if sampling.is_greedy:
        picks, row_max = ops.argmax(rows), ops.max(rows)
        temperature = None
    else:
        u = rng.random(tree.size)
        probs = target_probs(ops, rows, sampling)
        picks, row_max = inverse_cdf(ops, probs, ops.asarray(u[:, None])), ops.max(probs)
        temperature = sampling.temperature
    host = fetch(ops, [picks, row_max])
    picked, maxima = host[: tree.size], host[tree.size:]
    fail = partial(_raise_non_finite, ops, rows, 0, temperature=temperature)
    children = tree.children()
    node, path = 0, [0]
    while True:
        ok = math.isfinite(maxima[node]) if temperature is None else 0.0 < maxima[node] < math.inf
        if not ok:
            fail(node)
        child = children[node].get(int(picked[node]))
        if child is None:
            break
        node = child
        path.append(node)
    emitted = [tree.tokens[n] for n in path[1:]] + [int(picked[node])]
    return Verification(len(path) - 1, emitted, tuple(path))
