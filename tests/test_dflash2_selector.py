"""The DFlash2 candidate selector: score table, greedy chain walk, sampled walk, and the
losslessness of speculative sampling with its sparse q (statistical, with the real verifier)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from speculant.core.arrays import NumpyOps
from speculant.core.types import Draft, SamplingParams
from speculant.drafters.dflash2.selector import ScoreTable, greedy_walk, inverse_cdf, sampled_walk, softmax, walk
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier


def table_from(unary, edges, anchor_edge, candidates) -> ScoreTable:
    """S_0 = U_0 + anchor_edge; S_t(i, j) = U_t[j] + edges[t-1][i, j]."""
    unary = np.asarray(unary, np.float32)
    first = unary[0] + np.asarray(anchor_edge, np.float32)
    k, width = unary.shape
    pairs = np.zeros((k - 1, width, width), np.float32)
    for t in range(1, k):
        pairs[t - 1] = unary[t][None, :] + np.asarray(edges[t - 1], np.float32)
    return ScoreTable(first, pairs, np.asarray(candidates, np.int64))


def test_greedy_walk_follows_the_chain_not_each_rows_argmax():
    # Row argmaxes of the unary scores are candidate 0 everywhere; the bilinear edges make the
    # chain 0 -> 2 -> 1. Candidate ids are distinct so the tokens show which slot was taken.
    unary = [[2.0, 1.0, 0.5], [4.0, 0.0, 1.0], [3.0, 2.0, 0.0]]
    edges = [
        [[-9.0, 0.0, 0.5], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],  # after row-0 slot 0: slot 2 wins (1.5 > 0 > -5)
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-5.0, 0.5, 0.0]],  # after row-1 slot 2: slot 1 wins (2.5 > -2)
    ]
    candidates = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    table = table_from(unary, edges, [0.0, 0.0, 0.0], candidates)
    path = greedy_walk(table)
    assert path.indices == [0, 2, 1]
    assert path.token_ids == [10, 22, 31]
    per_row = [int(np.argmax(u)) for u in unary]
    assert per_row == [0, 0, 0] and path.indices != per_row
    assert path.q is None
    expected_conf = [softmax(table.first)[0], softmax(table.pairs[0, 0])[2], softmax(table.pairs[1, 2])[1]]
    assert path.confidence == pytest.approx([float(c) for c in expected_conf])


def test_greedy_walk_uses_the_anchor_edge_and_breaks_ties_low():
    table = table_from([[1.0, 1.0]], [], [0.0, 0.5], [[7, 8]])
    assert greedy_walk(table).token_ids == [8]  # the anchor's edge decides row 0
    tie = table_from([[1.0, 1.0]], [], [0.0, 0.0], [[7, 8]])
    assert greedy_walk(tie).token_ids == [7]


def test_sampled_walk_records_q_at_the_sampled_predecessor():
    unary = [[0.0, 0.0], [0.0, 0.0]]
    edges = [[[3.0, -3.0], [-3.0, 3.0]]]  # row 1 strongly copies row 0's slot
    table = table_from(unary, edges, [0.0, 0.0], [[1, 2], [3, 4]])
    for u0, slot in ((0.1, 0), (0.9, 1)):
        path = sampled_walk(table, 0.5, [u0, 0.5])
        assert path.indices[0] == slot
        np.testing.assert_allclose(path.q[0], [0.5, 0.5])
        np.testing.assert_allclose(path.q[1], softmax(table.pairs[0, slot], 0.5), rtol=1e-6)
        assert path.q.dtype == np.float32
        assert path.confidence == [float(path.q[t, path.indices[t]]) for t in range(2)]


def test_inverse_cdf_edges():
    probs = np.asarray([0.0, 0.25, 0.0, 0.75], np.float32)
    assert inverse_cdf(probs, 0.0) == 1  # never a zero-mass slot
    assert inverse_cdf(probs, 0.2499) == 1
    assert inverse_cdf(probs, 0.25) == 3
    assert inverse_cdf(probs, np.nextafter(1.0, 0.0)) == 3


def test_walk_dispatch_and_from_flat_roundtrip():
    rng = np.random.default_rng(0)
    k, K = 3, 4
    first, pairs = rng.standard_normal(K), rng.standard_normal((k - 1, K, K))
    candidates = rng.choice(1000, size=(k, K), replace=False)
    flat = np.concatenate([first, pairs.ravel(), candidates.ravel()]).astype(np.float32)
    table = ScoreTable.from_flat(flat, k, K)
    np.testing.assert_array_equal(table.candidates, candidates)
    np.testing.assert_allclose(table.pairs, pairs.astype(np.float32))
    assert walk(table, SamplingParams(0.0), None).q is None
    assert walk(table, SamplingParams(1.0), np.random.default_rng(1)).q.shape == (k, K)
    with pytest.raises(ValueError, match="rng"):
        walk(table, SamplingParams(1.0), None)


def test_torch_score_table_matches_the_formula(torch_threads):
    """S_t(a, b) = U_t(b) + sum_r A[a, r] * (W_h h_t)[r] * B[b, r], candidates = top-K."""
    import torch

    from speculant.drafters.dflash.config import DFlashConfig
    from speculant.drafters.dflash2.torch import CandidateSelector

    cfg = DFlashConfig(
        architecture="DFlash2DraftModel", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=50, rms_norm_eps=1e-6,
        max_position_embeddings=64, num_target_layers=4, target_layer_ids=[1], mask_token_id=49, block_size=8,
        layer_types=["full_attention"], sliding_window=None, is_causal=False,
        selector_rank=8, selector_top_k=5, conv_kernel_size=2, conv_group_size=16)
    torch.manual_seed(0)
    sel = CandidateSelector(cfg)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_()
    k, anchor = 4, 17
    hidden, logits = torch.randn(k, 32), torch.randn(k, 50)
    with torch.no_grad():
        flat, cand = sel.score_table(hidden, logits, anchor)
    table = ScoreTable.from_flat(torch.cat([flat, cand.reshape(-1).float()]).numpy(), k, 5)
    A, B = sel.predecessor_codebook.detach().double(), sel.successor_codebook.detach().double()
    z = (hidden.double() @ sel.hidden_projection.weight.detach().double().T)
    for t in range(k):
        assert set(table.candidates[t].tolist()) == set(torch.topk(logits[t], 5).indices.tolist())
        for i, a in enumerate([anchor] if t == 0 else table.candidates[t - 1]):
            for j, b in enumerate(table.candidates[t]):
                want = float(logits[t, b]) + float((A[a] * z[t] * B[b]).sum())
                got = table.first[j] if t == 0 else table.pairs[t - 1, i, j]
                assert got == pytest.approx(want, rel=1e-4, abs=1e-4)


# -- losslessness of speculative sampling with the sparse selector q ---------------------------

V, K, T = 4, 3, 0.8


def explicit_setting():
    """A fixed target (p_1, p_2(.|x_1), p_3(.|x_1, x_2)) over 4 tokens and a 2-row selector
    table over 3 candidates whose bilinear edges matter (q differs a lot from softmax(U/T))."""
    rng = np.random.default_rng(42)
    p1 = rng.dirichlet(np.full(V, 3.0))
    p2 = rng.dirichlet(np.full(V, 3.0), size=V)
    p3 = rng.dirichlet(np.full(V, 3.0), size=(V, V))
    unary = np.asarray([[0.5, 0.0, -0.5], [0.0, 0.5, 0.2]], np.float32)
    edges = [np.asarray([[2.0, -1.5, 0.0], [-1.0, 0.0, 2.0], [0.0, 2.0, -2.0]], np.float32)]
    anchor_edge = np.asarray([-1.0, 1.5, 0.0], np.float32)
    candidates = np.asarray([[0, 1, 2], [1, 2, 3]], np.int64)
    return (p1, p2, p3), table_from(unary, edges, anchor_edge, candidates), unary


def target_logits(p):
    """Logits that the verifier's temperature T turns back into p."""
    return (T * np.log(p)).astype(np.float32)


def run_explicit(trials, seed, q_from="selector"):
    (p1, p2, p3), table, unary = explicit_setting()
    ops, verifier = NumpyOps(), SpeculativeSamplingVerifier()
    sampling = SamplingParams(temperature=T)
    seeds = np.random.SeedSequence(seed).spawn(2)
    draft_rng, verify_rng = np.random.default_rng(seeds[0]), np.random.default_rng(seeds[1])
    counts = np.zeros((V, V), np.int64)
    for _ in range(trials):
        path = walk(table, sampling, draft_rng)
        q = {
            "selector": path.q,
            "unary": softmax(unary, T),  # broken: the draft's unary marginal
            "untempered": np.stack([softmax(table.row(t, None if t == 0 else path.indices[t - 1]), 1.0)
                                    for t in range(2)]),  # broken: q at T = 1 while the walk used T
        }[q_from]
        x1, x2 = path.token_ids
        draft = Draft(np.asarray(path.token_ids), 2, draft_probs=q, candidate_ids=table.candidates)
        logits = np.stack([target_logits(p1), target_logits(p2[x1]), target_logits(p3[x1, x2])])
        tokens = verifier.verify(ops, draft, logits, sampling, verify_rng).token_ids
        if len(tokens) == 1:  # rejected at row 0: the next position is a plain target step
            tokens = tokens + verifier.verify(ops, None, target_logits(p2[tokens[0]])[None], sampling, verify_rng).token_ids
        counts[tokens[0], tokens[1]] += 1
    expected = p1[:, None] * p2 * trials
    return counts, expected


def chi_square_pvalue(counts, expected):
    from scipy.stats import chisquare

    return chisquare(counts.ravel(), expected.ravel()).pvalue


def test_setting_really_exercises_the_selector():
    (_, _, _), table, unary = explicit_setting()
    q_true = softmax(table.pairs[0], T)  # q_2 given each predecessor
    q_unary = softmax(unary[1], T)
    assert np.abs(q_true - q_unary[None]).max() > 0.3
    assert np.abs(softmax(table.first, T) - softmax(unary[0], T)).max() > 0.3


def test_sparse_q_sampling_is_lossless():
    counts, expected = run_explicit(8000, seed=1)
    assert counts.sum() == 8000
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_q_from_unary_logits_is_caught():
    """Broken variant: q = softmax(U/T) instead of the selector's softmax(S/T)."""
    counts, expected = run_explicit(8000, seed=1, q_from="unary")
    assert chi_square_pvalue(counts, expected) < 1e-6


def test_q_at_the_wrong_temperature_is_caught():
    counts, expected = run_explicit(8000, seed=1, q_from="untempered")
    assert chi_square_pvalue(counts, expected) < 1e-6


def test_joint_cells_all_reachable():
    """Every (t1, t2) pair, including tokens outside the candidate sets, has mass."""
    (p1, p2, _), _, _ = explicit_setting()
    assert all(p1[a] * p2[a, b] * 20000 > 20 for a, b in itertools.product(range(V), range(V)))
