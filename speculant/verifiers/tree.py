"""Tree verification (DDTree, arXiv 2604.12989), written once over ArrayOps.

**Building.** A block drafter gives one distribution per block position q_1..q_L (marginals,
not conditioned on the path). The tree keeps the ``budget`` most probable prefixes under
Q(y) = prod q_d(y_d): a best-first heap over path log-probabilities on rank tuples, seeded with
rank 0 at depth 1; each pop adds a node and pushes its next sibling and its first child. Only the
``width`` most probable tokens per depth can appear (:func:`top_candidates`). A draft with path
scores (DFlash2's candidate selector: each candidate scored given the one before it) gets the
same heap over that chain model instead (:func:`selector_tree`, ``TreeShape``): measured on the
real pair it accepts more than the marginals (docs/tree-verification.md).

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
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from speculant.core.arrays import Array, ArrayOps
from speculant.core.sampling import inverse_cdf, target_probs
from speculant.core.tree import DraftTree, with_branch
from speculant.core.types import Draft, PathScores, SamplingParams, Verification
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


# (row, state of the parent) -> the row's candidates after that parent, most probable first, as
# (token, log-probability, state of the child); the root's state is -1
Children = Callable[[int, int], list[tuple[int, float, int]]]


def best_first(anchor_id: int, rows: int, children: Children, budget: int) -> DraftTree:
    """The ``budget`` most probable paths (root not counted) of a model whose candidates at each
    row may depend on the parent (``children``), in the order a best-first heap pops them: each
    pop adds a node and pushes its next sibling and its first child, so parents come first."""
    tokens, parents = [anchor_id], [-1]
    first = children(0, -1) if rows > 0 and budget > 0 else []
    # entries: (-path log-prob, rank tuple, parent node, the parent's ranked children); the rank
    # tuple names the prefix, so it breaks ties deterministically and the rest is never compared
    heap: list[tuple[float, tuple[int, ...], int, list]] = [(-first[0][1], (0,), 0, first)] if first else []
    while heap and len(tokens) - 1 < budget:
        negative, ranks, parent, options = heapq.heappop(heap)
        if negative == math.inf:
            break  # only zero-probability prefixes are left
        row, rank, score = len(ranks) - 1, ranks[-1], -negative
        token, logprob, state = options[rank]
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        if rank + 1 < len(options):
            heapq.heappush(heap, (-(score - logprob + options[rank + 1][1]), ranks[:-1] + (rank + 1,), parent, options))
        if row + 1 < rows:
            below = children(row + 1, state)
            if below:
                heapq.heappush(heap, (-(score + below[0][1]), ranks + (0,), node, below))
    return DraftTree(tuple(tokens), tuple(parents))


def build_tree(anchor_id: int, top_ids: list[list[int]], top_logprobs: list[list[float]], budget: int) -> DraftTree:
    """The ``budget`` most probable prefixes (root not counted) of the per-depth candidates under
    the product of the marginals, in the order the heap pops them (every parent before its children)."""
    ranked = [list(zip(ids, logprobs, [0] * len(ids))) for ids, logprobs in zip(top_ids, top_logprobs)]
    return best_first(anchor_id, len(ranked), lambda row, state: ranked[row], budget)


def selector_tree(anchor_id: int, scores: PathScores, log_mass: list[float], budget: int, width: int) -> DraftTree:
    """The ``budget`` most probable prefixes when a candidate's probability depends on its parent:
    softmax(S_t(parent, .)) over the row's selector candidates (DFlash2's path scores), times the
    share of row t's marginal those candidates hold (``log_mass[t]``, so that rows weigh against
    each other as under the marginals). Only a row's ``width`` best candidates after a parent can
    appear."""
    rows = len(log_mass)
    memo: dict[tuple[int, int], list[tuple[int, float, int]]] = {}

    def children(row: int, state: int) -> list[tuple[int, float, int]]:
        if (row, state) not in memo:
            raw = np.asarray(scores.first if row == 0 else scores.pairs[row - 1, state], dtype=np.float64)
            logprobs = raw - raw.max() - math.log(np.exp(raw - raw.max()).sum()) + log_mass[row]
            order = np.argsort(-logprobs, kind="stable")[:width]
            memo[row, state] = [(int(scores.candidates[row, j]), float(logprobs[j]), int(j)) for j in order]
        return memo[row, state]

    return best_first(anchor_id, rows, children, budget)


def draft_tree(ops: ArrayOps, draft: Draft, anchor_id: int, budget: int, width: int,
               shape: "TreeShape | None" = None) -> tuple[DraftTree, list[int]]:
    """The tree of ``draft``'s per-position distributions (``draft.logits``, which must be set),
    shaped as ``shape`` says, with its prompt-lookup copy (``draft.branch_ids``) as one more path;
    and the nodes only the copy proposed (beyond the budget)."""
    shape = shape or TreeShape()
    logits = draft.logits[: draft.num_tokens]
    scores = draft.path_scores if shape.scores == "selector" else None
    if scores is not None:
        rows = min(draft.num_tokens, int(scores.candidates.shape[0]))
        _, top_logprobs = top_candidates(ops, logits[:rows], int(scores.candidates.shape[1]))
        log_mass = [_logsumexp(row) for row in top_logprobs]
        tree = selector_tree(anchor_id, scores, log_mass, budget, width)
    else:
        top_ids, top_logprobs = top_candidates(ops, logits, width)
        tree = build_tree(anchor_id, top_ids, top_logprobs, budget)
    return with_branch(tree, draft.branch_ids) if draft.branch_ids else (tree, [])


@dataclass(frozen=True)
class TreeShape:
    """How a tree spends its budget: node scores from the draft's per-position marginals
    (``"marginal"``) or from its path selector where the draft has one (``"selector"``)."""

    scores: str = "selector"


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values)) if top > -math.inf else -math.inf


def tree_verify(
    ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams, rng: Any,
    chain_ids: Sequence[int] | None = None,
) -> Verification:
    """Sample and match over ``tree`` with the target's logits at every node ([T, V], node order).

    ``Verification.path`` holds the nodes of the anchor and the accepted drafts;
    ``Verification.chain_accepted`` how many of the chain's drafts the same picks accept, the chain
    being ``chain_ids`` (a prompt-lookup copy the tree carries) or else the tree's first children;
    greedy only. Sampling leaves it None: a sampled chain is not the tree's first-child path (a
    DFlash2 or MTP chain samples its own path) and speculative sampling accepts its drafts with
    min(1, p/q), more often than the target's samples match a path, so pairing would price the
    chain too low."""
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
    chain = chain_depth(children, picked, chain_ids) if temperature is None else None
    return Verification(len(path) - 1, emitted, tuple(path), chain)


def chain_depth(children: list[dict[int, int]], picked: Sequence[int], chain_ids: Sequence[int] | None) -> int:
    """How far the picks agree with one path of the tree: ``chain_ids``' tokens, or the first child
    (the most probable, lowest node number) at every depth."""
    node = depth = 0
    while children[node]:
        if chain_ids is None:
            token, child = min(children[node].items(), key=lambda item: item[1])
        elif depth < len(chain_ids) and chain_ids[depth] in children[node]:
            token, child = chain_ids[depth], children[node][chain_ids[depth]]
        else:
            break
        if int(picked[node]) != token:
            break
        node, depth = child, depth + 1
    return depth
