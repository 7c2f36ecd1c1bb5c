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
from speculant.verifiers.tree_sampled import ChainTests, SampledPath, coupled_parts, depth_counts, with_sampled_path


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
    ranked = marginal_ranks(top_ids, top_logprobs)
    return best_first(anchor_id, len(top_ids), ranked, budget)


def marginal_ranks(top_ids: list[list[int]], top_logprobs: list[list[float]]) -> Children:
    """Each row's candidates under the marginals, whatever the parent (the state is 0)."""
    ranked = [list(zip(ids, logprobs, [0] * len(ids))) for ids, logprobs in zip(top_ids, top_logprobs)]
    return lambda row, state: ranked[row]


def selector_ranks(scores: PathScores, log_mass: list[float]) -> Children:
    """Each row's selector candidates after a parent (its candidate slot; -1 for the root), all of
    them, ranked by softmax(S_t(parent, .)) plus the log of the share of row t's marginal those
    candidates hold (``log_mass[t]``, so that rows weigh against each other as under the marginals)."""
    memo: dict[tuple[int, int], list[tuple[int, float, int]]] = {}

    def ranked(row: int, state: int) -> list[tuple[int, float, int]]:
        if (row, state) not in memo:
            raw = np.asarray(scores.first if row == 0 else scores.pairs[row - 1, state], dtype=np.float64)
            logprobs = raw - raw.max() - math.log(np.exp(raw - raw.max()).sum()) + log_mass[row]
            order = np.argsort(-logprobs, kind="stable")
            memo[row, state] = [(int(scores.candidates[row, j]), float(logprobs[j]), int(j)) for j in order]
        return memo[row, state]

    return ranked


def selector_tree(anchor_id: int, scores: PathScores, log_mass: list[float], budget: int, width: int) -> DraftTree:
    """The ``budget`` most probable prefixes when a candidate's probability depends on its parent
    (DFlash2's path scores, :func:`selector_ranks`). Only a row's ``width`` best candidates after a
    parent can appear."""
    ranked = selector_ranks(scores, log_mass)
    return best_first(anchor_id, len(log_mass), lambda row, state: ranked(row, state)[:width], budget)


def draft_tree(ops: ArrayOps, draft: Draft, anchor_id: int, budget: int, width: int,
               shape: "TreeShape | None" = None) -> "BuiltTree":
    """The tree of ``draft``'s per-position distributions (``draft.logits``, which must be set),
    shaped as ``shape`` says; a sampled draft's own chain as one of its paths (a draft with q rows:
    its tokens were drawn from them, :mod:`speculant.verifiers.tree_sampled`); its prompt-lookup
    copy (``draft.branch_ids``) as one more path beyond the budget."""
    shape = shape or TreeShape()
    logits = draft.logits[: draft.num_tokens]
    scores = draft.path_scores if shape.scores == "selector" else None
    rows = draft.num_tokens if scores is None else min(draft.num_tokens, int(scores.candidates.shape[0]))
    coupled = draft.draft_probs is not None and budget > 0 and shape.chain_bonus > -math.inf
    path, path_logprobs = _chain(ops, draft.token_ids, logits, min(rows, budget)) if coupled else ([], [])
    if scores is not None:
        _, top_logprobs = top_candidates(ops, logits[:rows], int(scores.candidates.shape[1]))
        ranked = selector_ranks(scores, [_logsumexp(row) for row in top_logprobs])
        children: Children = lambda row, state: ranked(row, state)[:width]  # noqa: E731
    else:
        top_ids, top_logprobs = top_candidates(ops, logits, width)
        children = marginal_ranks(top_ids, top_logprobs)
        for row, (token, logprob) in enumerate(zip(path, path_logprobs)):  # the chain's own scores
            if token not in top_ids[row]:
                top_ids[row], top_logprobs[row] = top_ids[row] + [token], top_logprobs[row] + [logprob]
        ranked = marginal_ranks(top_ids, top_logprobs)
    tree, sampled = best_first(anchor_id, rows, children, budget), None
    if coupled:
        reserved = len(path) if shape.chain_bonus == math.inf else 0  # a whole chain needs a node per depth
        counts = depth_counts(tree, reserved, budget)
        tree, nodes = with_sampled_path(anchor_id, counts, children, ranked, path, shape.chain_bonus)
        whole = shape.chain_bonus == math.inf and len(path) == draft.num_tokens
        sampled = SampledPath(tuple(path), nodes, draft, whole)
    tree, copy_nodes = with_branch(tree, draft.branch_ids) if draft.branch_ids else (tree, [])
    return BuiltTree(tree, copy_nodes, sampled)


def _chain(ops: ArrayOps, token_ids: Array, logits: Array, length: int) -> tuple[list[int], list[float]]:
    """The draft's first ``length`` tokens and their log-probabilities under its marginals, in one
    transfer."""
    ids = token_ids[:length]
    logprobs = ops.gather(ops.log_softmax(ops.float32(logits[:length])), ids[:, None])[:, 0]
    host = fetch(ops, [ids, logprobs])
    return [int(t) for t in host[:length]], host[length:]


@dataclass(frozen=True)
class BuiltTree:
    """A cycle's tree, the nodes only its prompt-lookup copy proposed, and the draft's sampled chain
    in it (None for a draft not sampled from q rows)."""

    tree: DraftTree
    copy_nodes: list[int]
    sampled: SampledPath | None = None


@dataclass(frozen=True)
class TreeShape:
    """How a tree spends its budget: node scores from the draft's per-position marginals
    (``"marginal"``) or from its path selector where the draft has one (``"selector"``)."""

    scores: str = "selector"
    chain_bonus: float = 0.0  # a sampled chain's node is kept while its log-probability plus this
    # reaches the weakest node kept at its depth (inf: always, within the budget; -inf: no chain)


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values)) if top > -math.inf else -math.inf


def tree_verify(
    ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams, rng: Any,
    chain_ids: Sequence[int] | None = None, sampled: SampledPath | None = None,
) -> Verification:
    """Sample and match over ``tree`` with the target's logits at every node ([T, V], node order);
    under sampling, speculative sampling at the nodes of the draft's ``sampled`` chain.

    ``Verification.path`` holds the nodes of the anchor and the accepted drafts;
    ``Verification.chain_accepted`` how many of the chain's drafts the same draws accept: greedy,
    the chain being ``chain_ids`` (a prompt-lookup copy the tree carries) or else the tree's first
    children; sampled, the ``sampled`` chain's (speculative sampling's own count). A sampled tree
    without that chain leaves it None: the chain's own rule, min(1, p/q) over drafts drawn from q,
    accepts more often than the target's draws match a fixed path, so pairing would price it too low.
    Uniforms per sampled cycle: one per node, then one per drafted token of ``sampled``."""
    rows = verify_rows(target_logits, tree.size - 1)
    sampled = None if sampling.is_greedy else sampled
    parts, tests = [], None
    if sampling.is_greedy:
        picks, row_max = ops.argmax(rows), ops.max(rows)
        temperature = None
    else:
        m = 0 if sampled is None else sampled.tested
        u = rng.random(tree.size + m)
        probs = target_probs(ops, rows, sampling)
        picks, row_max = inverse_cdf(ops, probs, ops.asarray(u[: tree.size, None])), ops.max(probs)
        temperature = sampling.temperature
        if m:
            parts = coupled_parts(ops, probs, sampled, u)
    host = fetch(ops, [picks, row_max] + parts)
    picked, maxima = host[: tree.size], host[tree.size : 2 * tree.size]
    if parts:
        m, rest = sampled.tested, host[2 * tree.size :]
        tests = ChainTests(sampled, rest[:m], rest[m : 2 * m], rest[2 * m :], u[tree.size :])
    fail = partial(_raise_non_finite, ops, rows, 0, temperature=temperature)
    children = tree.children()
    node, path = 0, [0]
    while True:
        ok = math.isfinite(maxima[node]) if temperature is None else 0.0 < maxima[node] < math.inf
        if not ok:
            fail(node)
        child, token = tests.step(node) if tests is not None else (None, None)
        if child is None:
            token = int(picked[node]) if token is None else token
            child = children[node].get(token)
        if child is None:
            break
        node = child
        path.append(node)
    emitted = [tree.tokens[n] for n in path[1:]] + [token]
    if temperature is None:
        chain = chain_depth(children, picked, chain_ids)
    else:
        chain = tests.accepted() if tests is not None and sampled.whole else None
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
