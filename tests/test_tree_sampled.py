"""A sampled draft's chain inside its tree (speculant/verifiers/tree_sampled.py): the tree above a
depth never depends on a later draw, the chain's nodes are verified by speculative sampling and the
output still follows the target (chi-square), and the tree accepts at least what its chain does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from speculant.core.arrays import NumpyOps
from speculant.core.types import Draft, SamplingParams
from speculant.verifiers.tree import TreeShape, build_tree, draft_tree, marginal_ranks, top_candidates, tree_verify
from speculant.verifiers.tree_sampled import depth_counts, with_sampled_path
from stats_helpers import gof_pvalue

NP = NumpyOps()
V = 6


def paths_of(tree, max_depth: int | None = None) -> set[tuple[int, ...]]:
    out = set()
    for i in range(1, tree.size):
        if max_depth is None or tree.depths[i] <= max_depth:
            out.add(tuple(tree.tokens[n] for n in tree.path_to(i)[1:]))
    return out


def marginal_build(seed: int, depth: int = 4, vocab: int = 9, width: int = 3):
    logits = np.random.default_rng(seed).normal(0.0, 2.0, size=(depth, vocab)).astype(np.float32)
    ids, logprobs = top_candidates(NP, logits, width)
    return ids, logprobs, marginal_ranks(ids, logprobs)


@pytest.mark.parametrize("seed", range(4))
def test_the_tree_above_a_depth_does_not_depend_on_later_draws(seed):
    ids, logprobs, ranked = marginal_build(seed)
    budget = 9
    plain = build_tree(0, ids, logprobs, budget)
    rng = np.random.default_rng(seed)
    def draw(rows: range) -> list[int]:  # a chain among the rows' candidates (not all in the plain tree)
        return [int(ids[r][rng.integers(0, len(ids[r]))]) for r in rows]

    for _ in range(20):
        path = draw(range(4))
        counts = depth_counts(plain, len(path), budget)
        tree, nodes = with_sampled_path(0, counts, ranked, ranked, path)
        assert tree.size - 1 == budget == sum(counts)
        assert [tree.tokens[n] for n in nodes[1:]] == path and tree.path_to(nodes[-1]) == list(nodes)
        for bonus in (math.inf, 0.0):
            tree, _ = with_sampled_path(0, counts, ranked, ranked, path, bonus)
            for d in range(1, 4):  # the same first d draws give the same tree down to depth d
                again, _ = with_sampled_path(0, counts, ranked, ranked, path[:d] + draw(range(d, 4)), bonus)
                assert paths_of(again, d) == paths_of(tree, d)


@pytest.mark.parametrize("seed", range(3))
def test_a_chain_the_tree_already_holds_leaves_the_tree_as_it_was(seed):
    ids, logprobs, ranked = marginal_build(seed)
    plain = build_tree(0, ids, logprobs, 9)
    first = [plain.tokens[n] for n in plain.path_to(max(range(plain.size), key=lambda i: plain.depths[i]))[1:]]
    tree, nodes = with_sampled_path(0, depth_counts(plain, len(first), 9), ranked, ranked, first)
    assert paths_of(tree) == paths_of(plain) and len(nodes) == len(first) + 1


# -- verification: exact, and at least the chain -----------------------------------------------

P_ROOT = np.array([0.30, 0.25, 0.20, 0.15, 0.10, 0.0])
Q = np.array([[0.10, 0.10, 0.10, 0.10, 0.60, 0.0],  # the draft's rows: its chain is accepted half the time
              [0.10, 0.40, 0.20, 0.10, 0.10, 0.10]])
MARGINALS = np.log(np.array([[0.05, 0.10, 0.50, 0.30, 0.05, 1e-9],  # what the tree ranks by
                             [0.30, 0.30, 0.20, 0.10, 0.05, 0.05]]))


def p_after(tokens: tuple[int, ...]) -> np.ndarray:
    """The target's distribution after the path ``tokens`` (a fixed table per path)."""
    if not tokens:
        return P_ROOT
    weights = np.random.default_rng(hash(tokens) % 2**32).dirichlet(np.ones(V))
    return weights


def node_logits(tree) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.stack([p_after(tuple(tree.tokens[n] for n in tree.path_to(i)[1:]))
                                for i in range(tree.size)])).astype(np.float32)


def sampled_cycle(rng, budget: int = 3, width: int = 2, sparse: bool = False, bonus: float = math.inf):
    """One cycle: the chain drawn from Q, its tree, the target's rows over it."""
    x = [int(rng.choice(V, p=Q[t])) for t in range(2)]
    if sparse:  # q over the row's candidates, as DFlash2 proposes
        q, ids = Q[:, :5].astype(np.float32), np.tile(np.arange(5), (2, 1))
    else:
        q, ids = Q.astype(np.float32), None
    draft = Draft(NP.asarray(np.array(x), "int64"), 2, draft_probs=q, candidate_ids=ids,
                  logits=MARGINALS.astype(np.float32))
    built = draft_tree(NP, draft, 0, budget, width, TreeShape(scores="marginal", chain_bonus=bonus))
    return built, node_logits(built.tree)


@pytest.mark.parametrize("sparse, bonus", [(False, math.inf), (True, math.inf), (False, 0.0), (True, 0.0)])
def test_sampled_chain_nodes_keep_the_targets_distribution(sparse, bonus):
    """The whole chain in the tree (bonus inf), and the chain only where it ranks in (bonus 0): there
    a node whose chain token the tree left out still tests it (otherwise whether a node tests
    would depend on the token it tests, and token 4, the draft's favourite, would come too often)."""
    rng, sampling = np.random.default_rng(5), SamplingParams(temperature=1.0)
    first, second = [], {}
    for _ in range(6000):
        built, logits = sampled_cycle(rng, sparse=sparse, bonus=bonus)
        result = tree_verify(NP, built.tree, logits, sampling, rng, None, built.sampled)
        first.append(result.token_ids[0])
        if result.accepted >= 1:
            second.setdefault(result.token_ids[0], []).append(result.token_ids[1])
    assert gof_pvalue(np.array(first), P_ROOT) > 1e-3
    for token, seen in second.items():
        if len(seen) > 400:
            assert gof_pvalue(np.array(seen), p_after((token,))) > 1e-3


def test_the_tree_accepts_at_least_its_chain_and_more_than_sample_and_match():
    rng, sampling = np.random.default_rng(6), SamplingParams(temperature=1.0)
    coupled, matched, chain = [], [], []
    for _ in range(3000):
        built, logits = sampled_cycle(rng, budget=4, width=3)
        assert built.sampled is not None and built.sampled.tested == 2
        result = tree_verify(NP, built.tree, logits, sampling, rng, None, built.sampled)
        assert result.accepted >= result.chain_accepted
        coupled.append(result.accepted)
        chain.append(result.chain_accepted)
        matched.append(tree_verify(NP, built.tree, logits, sampling, rng).accepted)
    assert np.mean(coupled) > np.mean(chain) + 0.05
    assert np.mean(coupled) > np.mean(matched) + 0.05


def test_greedy_trees_ignore_the_sampled_chain():
    rng = np.random.default_rng(7)
    built, logits = sampled_cycle(rng)
    result = tree_verify(NP, built.tree, logits, SamplingParams(), None, None, built.sampled)
    plain = tree_verify(NP, built.tree, logits, SamplingParams(), None)
    assert result == plain


def test_budget_counts_hold_the_chain_and_give_nodes_back_from_the_widest_depth():
    from speculant.core.tree import DraftTree

    wide = DraftTree((0, 1, 2, 3, 4), (-1, 0, 0, 0, 0))  # four nodes at depth 1
    assert depth_counts(wide, 3, 4) == [2, 1, 1]
    assert depth_counts(wide, 0, 4) == [4]
    assert depth_counts(wide, 2, 6) == [4, 1]
