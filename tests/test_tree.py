"""Tree verification math (speculant/core/tree.py, speculant/verifiers/tree.py) on explicit tables:
the tree's shape against per-path chains, the best-first build against brute force, the greedy
walk, and sample-and-match against a chi-square test that rejects the biased min(1, p/q) rule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from speculant.core.arrays import NumpyOps
from speculant.core.errors import NonFiniteLogitsError
from speculant.core.tree import DraftTree
from speculant.core.types import SamplingParams
from speculant.verifiers.tree import build_tree, top_candidates, tree_verify
from stats_helpers import gof_pvalue
from test_verifiers import make_ops

NP = NumpyOps()


def random_marginals(seed: int, depth: int, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 2.0, size=(depth, vocab)).astype(np.float32)


def random_tree(seed: int = 0, depth: int = 5, vocab: int = 11, width: int = 3, budget: int = 14) -> DraftTree:
    ids, logprobs = top_candidates(NP, random_marginals(seed, depth, vocab), width)
    return build_tree(7, ids, logprobs, budget)


@pytest.mark.parametrize("seed", range(4))
def test_mask_and_positions_equal_each_root_to_leaf_path_run_as_its_own_chain(seed):
    tree = random_tree(seed)
    prefix = 23
    mask, positions = tree.ancestor_mask(), tree.positions(prefix)
    assert tree.size == 15 and len(tree.leaves()) > 1  # a real tree, not a chain
    covered = set()
    for leaf in tree.leaves():
        path = tree.path_to(leaf)
        chain = DraftTree.chain([tree.tokens[n] for n in path])
        chain_mask, chain_positions = chain.ancestor_mask(), chain.positions(prefix)
        for c, node in enumerate(path):
            assert positions[node] == chain_positions[c]
            visible = [j for j in range(tree.size) if mask[node, j]]
            assert visible == [path[j] for j in range(len(path)) if chain_mask[c, j]]
            covered.add(node)
    assert covered == set(range(tree.size))


@pytest.mark.parametrize("seed", range(3))
def test_build_keeps_the_budget_most_probable_prefixes(seed):
    depth, width, budget = 4, 3, 17
    logits = random_marginals(seed, depth, 9)
    ids, logprobs = top_candidates(NP, logits, width)
    tree = build_tree(0, ids, logprobs, budget)
    scores = {}
    for length in range(1, depth + 1):
        for ranks in itertools.product(range(width), repeat=length):
            scores[tuple(ids[d][r] for d, r in enumerate(ranks))] = sum(logprobs[d][r] for d, r in enumerate(ranks))
    best = sorted(scores, key=scores.get, reverse=True)[:budget]
    built = {tuple(tree.tokens[n] for n in tree.path_to(i)[1:]) for i in range(1, tree.size)}
    assert built == set(best)
    assert all(p < i for i, p in enumerate(tree.parents))


def test_top_candidates_are_the_largest_log_probabilities():
    logits = random_marginals(5, 3, 10)
    ids, logprobs = top_candidates(NP, logits, 4)
    reference = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    for r in range(3):
        assert ids[r] == list(np.argsort(-logits[r], kind="stable")[:4])
        np.testing.assert_allclose(logprobs[r], reference[r, ids[r]], rtol=1e-5)


def one_hot_rows(picks: list[int], vocab: int = 12) -> np.ndarray:
    rows = np.zeros((len(picks), vocab), dtype=np.float32)
    rows[np.arange(len(picks)), picks] = 3.0
    return rows


@pytest.mark.parametrize("backend", ["numpy", "torch", "mlx"])
def test_greedy_walk_follows_the_argmax_through_the_children(backend):
    ops = make_ops(backend)
    #        0(root=5)
    #       /        \
    #    1(tok 2)   2(tok 3)
    #     |          /     \
    #    3(tok 4)  4(tok 1) 5(tok 6)
    tree = DraftTree((5, 2, 3, 4, 1, 6), (-1, 0, 0, 1, 2, 2))
    # the argmax at the root is 3 (node 2), at node 2 it is 6 (node 5), at node 5 it is 9: bonus
    result = tree_verify(ops, tree, ops.asarray(one_hot_rows([3, 0, 6, 0, 0, 9])), SamplingParams(), None)
    assert (result.accepted, result.token_ids, result.path) == (2, [3, 6, 9], (0, 2, 5))
    # the root's argmax is no child: the correction only
    result = tree_verify(ops, tree, ops.asarray(one_hot_rows([8, 4, 6, 0, 0, 9])), SamplingParams(), None)
    assert (result.accepted, result.token_ids, result.path) == (0, [8], (0,))


def test_greedy_walk_stops_on_a_non_finite_row_it_reaches_only():
    tree = DraftTree((5, 2, 3), (-1, 0, 0))
    rows = one_hot_rows([3, 0, 7])
    rows[1, 0] = np.nan  # node 1 is never reached
    assert tree_verify(NP, tree, rows, SamplingParams(), None).token_ids == [3, 7]
    rows[2, 0] = np.nan
    with pytest.raises(NonFiniteLogitsError, match="row 2 contain NaN"):
        tree_verify(NP, tree, rows, SamplingParams(), None)


# -- sampling: sample and match is exact, min(1, p/q) on top-k children is not -------------

P_ROOT = np.array([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])  # the target at the root
Q_FIRST = np.array([0.6, 0.3, 0.05, 0.03, 0.02, 0.0])  # the draft's marginal at depth 1
P_CHILD = np.array([0.05, 0.05, 0.4, 0.3, 0.1, 0.1])  # the target after either child
TREE = DraftTree((4, 0, 1, 2, 3), (-1, 0, 0, 1, 2))  # the draft's top-2 at depth 1, each with a child
TRIALS = 6000


def target_logits() -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(np.stack([P_ROOT, P_CHILD, P_CHILD, P_CHILD, P_CHILD])).astype(np.float32)


def biased_first_token(rng) -> int:
    """The chain rule on a top-k tree: accept child x with min(1, p(x) / q(x)), in rank order,
    on rejection move p to the residual normalise(max(p - q, 0)); emit from p when all fail."""
    p = P_ROOT.copy()
    for child in (1, 2):
        x = TREE.tokens[child]
        if rng.random() * Q_FIRST[x] < p[x]:
            return x
        p = np.maximum(p - Q_FIRST, 0.0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))


def test_sample_and_match_passes_chi_square_and_the_biased_rule_fails_it():
    rng = np.random.default_rng(1)
    logits, sampling = target_logits(), SamplingParams(temperature=1.0)
    exact = np.array([tree_verify(NP, TREE, logits, sampling, rng).token_ids[0] for _ in range(TRIALS)])
    biased = np.array([biased_first_token(rng) for _ in range(TRIALS)])
    assert gof_pvalue(exact, P_ROOT) > 1e-3
    assert gof_pvalue(biased, P_ROOT) < 1e-6


def test_sample_and_match_second_token_follows_the_target_after_an_accepted_child():
    rng = np.random.default_rng(2)
    logits, sampling = target_logits(), SamplingParams(temperature=1.0)
    results = [tree_verify(NP, TREE, logits, sampling, rng) for _ in range(TRIALS)]
    second = np.array([r.token_ids[1] for r in results if r.accepted >= 1])
    assert gof_pvalue(second, P_CHILD) > 1e-3
    assert math.isclose(len(second) / TRIALS, P_ROOT[0] + P_ROOT[1], abs_tol=0.03)


def test_sampled_uniforms_and_tokens_are_the_same_on_every_backend():
    logits, sampling = target_logits(), SamplingParams(temperature=0.8, top_p=0.9)
    runs = {}
    for name in ("numpy", "torch", "mlx"):
        try:
            ops = make_ops(name)
        except pytest.skip.Exception:
            continue
        rng = np.random.default_rng(3)
        runs[name] = [tree_verify(ops, TREE, ops.asarray(logits), sampling, rng).token_ids for _ in range(50)]
    assert len(runs) >= 2 and all(r == runs["numpy"] for r in runs.values())


# -- choose = measured: tree or chain from tokens per second ---------------------------------------

def drive_choice(verifier, cycles: int, seconds: dict, paired: int | None = None) -> list[str]:
    """Run the verifier's hooks for drafted cycles; a tree cycle emits 4 tokens, a chain cycle 2,
    in ``seconds[kind]``; a tree's chain path accepts ``paired`` of its drafts (None: unknown).
    Returns the kinds run."""
    from speculant.core.types import CycleTiming, Draft, Verification

    logits = random_marginals(0, 4, 9)
    kinds = []
    for _ in range(cycles):
        draft = Draft(NP.argmax(logits), 4, logits=logits)
        tree = verifier.tree(NP, draft, 1)
        kind = "chain" if tree is None else "tree"
        verification = (Verification(3, [1, 2, 3, 4], (0, 1, 2, 3), paired) if tree is not None
                        else Verification(1, [1, 2]))
        verifier.observe(verification, 4, CycleTiming(100, 4, 4, seconds[kind]))
        kinds.append(kind)
    return kinds


def test_measured_choice_runs_the_faster_kind_and_explores_the_other_ever_less():
    from speculant.verifiers.tree_verifier import TreeVerifier

    verifier = TreeVerifier({"choose": "measured", "explore_every": 5})
    assert verifier.needs_timings
    # trees: 4 tokens in 2 ms (2000/s); chains: 2 tokens in 2 ms (1000/s)
    kinds = drive_choice(verifier, 200, {"tree": 2e-3, "chain": 2e-3})
    assert kinds[:6] == ["chain"] * 3 + ["tree"] * 3  # the warm-up
    explored = [i for i, kind in enumerate(kinds) if kind == "chain"][3:]
    gaps = np.diff(explored)
    assert len(explored) >= 4 and list(gaps) == sorted(gaps) and gaps[-1] >= 4 * gaps[0]  # spaced ever wider
    assert kinds[6:].count("tree") >= 0.95 * len(kinds[6:])
    # trees get expensive (4 tokens in 8 ms, 500/s): trees run, so the choice moves to chains at once
    kinds = drive_choice(verifier, 60, {"tree": 8e-3, "chain": 2e-3})
    assert kinds[10:].count("chain") >= 0.85 * len(kinds[10:]) and "tree" in kinds[10:]
    assert verifier.decisions()["choice"]["tokens_per_s"]["chain"] == pytest.approx(1000.0)


def test_measured_choice_weighs_a_tree_against_its_own_chain_path():
    """Trees emit 4 tokens in 3 ms and chains 2 in 2 ms; when the trees' own chain paths would have
    emitted 4 as well (the chain's cycles just ran on harder text), the tree adds nothing at 1.5x
    the cost and the chain must win; told nothing of the chain path, the tree wins."""
    from speculant.verifiers.tree_verifier import TreeVerifier

    costs = {"tree": 3e-3, "chain": 2e-3}
    paired = drive_choice(TreeVerifier({"choose": "measured", "explore_every": 5}), 80, costs, paired=3)
    unpaired = drive_choice(TreeVerifier({"choose": "measured", "explore_every": 5}), 80, costs)
    assert paired[10:].count("chain") >= 0.85 * 70 and unpaired[10:].count("tree") >= 0.85 * 70


def test_measured_choice_keeps_cycles_beside_a_copy_apart():
    """Beside a prompt-lookup copy a chain verifies the copy and runs no drafter (cheap); without
    one it drafts. The two kinds of cycle are measured apart, so each gets its own winner."""
    from speculant.verifiers.tree_verifier import CostChoice

    choice = CostChoice(8)
    seconds = {("chain", True): 1e-3, ("chain", False): 4e-3, ("tree", True): 3e-3, ("tree", False): 3e-3}
    runs: dict[bool, list[str]] = {True: [], False: []}
    for _ in range(100):
        for copy in (True, False):
            arm = choice.next(copy)
            choice.record(arm, 4 if arm == "tree" or copy else 3, seconds[arm, copy], copy)
            runs[copy].append(arm)
    assert runs[True][6:].count("chain") >= 0.9 * 94 and runs[False][6:].count("tree") >= 0.9 * 94


def test_tree_verify_reports_what_the_chain_path_accepts():
    """``chain_accepted``: the drafts of the first-child path (or of a given copy) the target's
    picks accept, equal to a greedy chain verification of that path."""
    from speculant.core.types import Draft
    from speculant.verifiers.acceptance import greedy_verify

    children = TREE.children()
    first_path, node = [], 0
    while children[node]:
        token, node = min(children[node].items(), key=lambda item: item[1])
        first_path.append((token, node))
    chain_nodes = [0] + [n for _, n in first_path]
    for seed in range(20):
        logits = np.random.default_rng(seed).normal(0, 1, (TREE.size, 9)).astype(np.float32)
        for token, n in first_path[: seed % 3]:  # plant agreement along the chain path
            logits[TREE.parents[n], token] += 10.0
        verification = tree_verify(NP, TREE, logits, SamplingParams(), None)
        chain = greedy_verify(NP, Draft(np.array([t for t, _ in first_path]), len(first_path)), logits[chain_nodes])
        assert verification.chain_accepted == chain.accepted
    copy = [TREE.tokens[n] for n in TREE.path_to(TREE.size - 1)[1:]]
    logits = np.full((TREE.size, 9), -5.0, np.float32)
    for parent, n in zip(TREE.path_to(TREE.size - 1), TREE.path_to(TREE.size - 1)[1:]):
        logits[parent, TREE.tokens[n]] = 5.0
    assert tree_verify(NP, TREE, logits, SamplingParams(), None, copy).chain_accepted == len(copy)
    # sampled, a chain is not the tree's path and is accepted by min(1, p/q): no pairing
    sampled = tree_verify(NP, TREE, logits, SamplingParams(temperature=0.8), np.random.default_rng(0), copy)
    assert sampled.chain_accepted is None and sampled.accepted > 0


def test_always_verifies_trees_without_timing():
    from speculant.verifiers.tree_verifier import TreeVerifier

    verifier = TreeVerifier()
    assert not verifier.needs_timings
    assert set(drive_choice(verifier, 10, {"tree": 8e-3, "chain": 1e-3})) == {"tree"}


# -- shaping: which nodes get the budget --------------------------------------------------------

def random_path_scores(seed: int, rows: int, k: int, vocab: int):
    from speculant.drafters.dflash2.selector import ScoreTable

    rng = np.random.default_rng(seed)
    candidates = np.stack([rng.permutation(vocab)[:k] for _ in range(rows)])
    return ScoreTable(rng.normal(0, 2, k).astype(np.float32), rng.normal(0, 2, (rows - 1, k, k)).astype(np.float32),
                      candidates)


@pytest.mark.parametrize("seed", range(3))
def test_selector_build_keeps_the_budget_most_probable_prefixes_given_each_parent(seed):
    """Under DFlash2's path scores a candidate's probability depends on its parent's candidate:
    the tree holds the most probable prefixes of that chain model (brute force over all paths)."""
    from speculant.verifiers.tree import selector_tree

    rows, k, budget = 3, 4, 15
    scores = random_path_scores(seed, rows, k, 30)
    log_mass = [-0.1, -0.5, -0.3]

    def log_q(row: int, parent: int | None) -> np.ndarray:
        z = (scores.first if row == 0 else scores.pairs[row - 1, parent]).astype(np.float64)
        return z - np.log(np.exp(z).sum()) + log_mass[row]

    paths = {}
    for length in range(1, rows + 1):
        for slots in itertools.product(range(k), repeat=length):
            logp = sum(log_q(t, slots[t - 1] if t else None)[j] for t, j in enumerate(slots))
            paths[tuple(int(scores.candidates[t, j]) for t, j in enumerate(slots))] = logp
    best = sorted(paths, key=paths.get, reverse=True)[:budget]
    tree = selector_tree(0, scores, log_mass, budget, k)
    assert {tuple(tree.tokens[n] for n in tree.path_to(i)[1:]) for i in range(1, tree.size)} == set(best)
    assert all(p < i for i, p in enumerate(tree.parents))


def two_row_draft():
    """Marginals rank 1 over 2 (row 0) and 3 over 4 (row 1); DFlash2's selector says 4 follows 1
    and 3 follows 2."""
    from speculant.core.types import Draft
    from speculant.drafters.dflash2.selector import ScoreTable

    logits = np.full((2, 10), -9.0, dtype=np.float32)
    logits[0, [1, 2]] = [3.0, 2.0]
    logits[1, [3, 4]] = [3.0, 2.0]
    scores = ScoreTable(np.array([3.0, 2.0], dtype=np.float32),
                        np.array([[[-5.0, 5.0], [5.0, -5.0]]], dtype=np.float32), np.array([[1, 2], [3, 4]]))
    return Draft(NP.asarray(np.array([1, 4])), 2, logits=logits, path_scores=scores)


def test_selector_scores_put_the_selectors_child_first():
    from speculant.core.types import Draft
    from speculant.verifiers.tree import TreeShape, draft_tree

    draft = two_row_draft()
    marginal, _ = draft_tree(NP, draft, 0, 3, 2, TreeShape(scores="marginal"))
    selected, _ = draft_tree(NP, draft, 0, 3, 2, TreeShape(scores="selector"))
    assert marginal.tokens == (0, 1, 3, 2) and marginal.parents == (-1, 0, 1, 0)
    assert selected.tokens == (0, 1, 4, 2) and selected.parents == (-1, 0, 1, 0)
    # a draft without path scores keeps the marginal tree
    plain = Draft(draft.token_ids, 2, logits=draft.logits)
    assert draft_tree(NP, plain, 0, 3, 2, TreeShape(scores="selector"))[0] == marginal


def test_the_tree_verifier_reads_its_shape_options():
    from speculant.verifiers.tree_verifier import TreeVerifier

    draft = two_row_draft()
    assert TreeVerifier({"budget": 3, "width": 2, "scores": "marginal"}).tree(NP, draft, 0).tokens == (0, 1, 3, 2)
    assert TreeVerifier({"budget": 3, "width": 2}).tree(NP, draft, 0).tokens == (0, 1, 4, 2)  # the default
    assert TreeVerifier({"scores": "marginal"}).decisions()["scores"] == "marginal"
