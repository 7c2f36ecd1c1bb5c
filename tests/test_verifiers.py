"""Verifier math on explicit probability tables: greedy rule, processing, edge cases, parity.

Every test runs over NumPy, PyTorch and (when its ops module exists) MLX ArrayOps.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from speculant.core.arrays import NumpyOps
from stats_helpers import reference_probs
from speculant.core.errors import NonFiniteLogitsError
from speculant.core.types import Draft, SamplingParams
from speculant.verifiers import acceptance
from speculant.verifiers.greedy import GreedyVerifier
from speculant.core.sampling import inverse_cdf, sample_token, target_probs
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)


def make_ops(name: str):
    if name == "numpy":
        return NumpyOps()
    if name == "torch":
        pytest.importorskip("torch")
        return importlib.import_module("speculant.backends.torch.ops").TorchOps()
    pytest.importorskip("mlx.core")
    module = pytest.importorskip("speculant.backends.mlx.ops")
    classes = [c for c in vars(module).values() if isinstance(c, type) and getattr(c, "name", None) == "mlx"]
    return classes[0]()


@pytest.fixture(params=["numpy", "torch", "mlx"])
def ops(request):
    return make_ops(request.param)


class Uniforms:
    """A stand-in for numpy.random.Generator that returns injected uniforms in order."""

    def __init__(self, values):
        self.values = list(values)
        self.used = 0

    def random(self, size=None):
        n = 1 if size is None else int(np.prod(size))
        out = np.array(self.values[self.used : self.used + n], dtype=np.float64)
        assert len(out) == n, "the verifier asked for more uniforms than the test injected"
        self.used += n
        return float(out[0]) if size is None else out.reshape(size)




def f32(ops, values):
    return ops.asarray(np.asarray(values, dtype=np.float32))


def ids(ops, values):
    return ops.asarray(np.asarray(values, dtype=np.int64), dtype="int64")


def one_hot_logits(best_ids, vocab=6):
    rows = np.zeros((len(best_ids), vocab), dtype=np.float32)
    for r, t in enumerate(best_ids):
        rows[r, t] = 3.0
    return rows


# -- greedy --------------------------------------------------------------------------------

BEST = [3, 1, 4, 2]  # target argmax of rows 0..3


@pytest.mark.parametrize("verifier", [GreedyVerifier(), SpeculativeSamplingVerifier()], ids=["greedy", "speculative"])
@pytest.mark.parametrize(
    "drafts, accepted, tokens",
    [
        ([3, 1, 4], 3, [3, 1, 4, 2]),  # all accepted: k + 1 tokens including the bonus
        ([0, 1, 4], 0, [3]),  # mismatch at the first draft: the correction only
        ([3, 0, 4], 1, [3, 1]),
        ([3, 1, 0], 2, [3, 1, 4]),
    ],
)
def test_greedy_prefix_rule(ops, verifier, drafts, accepted, tokens):
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    result = verifier.verify(ops, Draft(ids(ops, drafts), 3), f32(ops, one_hot_logits(BEST)), GREEDY, rng)
    assert (result.accepted, result.token_ids) == (accepted, tokens)
    assert rng.bit_generator.state == state  # temperature 0 consumes no randomness


@pytest.mark.parametrize("verifier", [GreedyVerifier(), SpeculativeSamplingVerifier()], ids=["greedy", "speculative"])
def test_greedy_without_draft_is_plain_argmax(ops, verifier):
    logits = one_hot_logits(BEST)
    result = verifier.verify(ops, None, f32(ops, logits[:1]), GREEDY, None)
    assert (result.accepted, result.token_ids) == (0, [3])
    assert verifier.verify(ops, None, f32(ops, logits), GREEDY, None).token_ids == [3]  # row 0 only
    assert verifier.verify(ops, Draft(ids(ops, []), 0), f32(ops, logits[:1]), GREEDY, None).token_ids == [3]


@pytest.mark.parametrize("verifier", [GreedyVerifier(), SpeculativeSamplingVerifier()], ids=["greedy", "speculative"])
def test_greedy_ties_take_the_lowest_index_like_plain_decoding(ops, verifier):
    logits = np.array([[1.0, 5.0, 5.0, 2.0], [7.0, 0.0, 7.0, 7.0]], dtype=np.float32)
    plain = verifier.verify(ops, None, f32(ops, logits[:1]), GREEDY, None).token_ids
    assert plain == [1]
    assert verifier.verify(ops, Draft(ids(ops, [2]), 1), f32(ops, logits), GREEDY, None).token_ids == [1]
    assert verifier.verify(ops, Draft(ids(ops, [1]), 1), f32(ops, logits), GREEDY, None).token_ids == [1, 0]


def test_greedy_ignores_draft_probabilities(ops):
    logits = f32(ops, one_hot_logits(BEST))
    q = f32(ops, np.full((3, 6), 1 / 6))
    dense = Draft(ids(ops, [3, 1, 0]), 3, q)
    sparse = Draft(ids(ops, [3, 1, 0]), 3, f32(ops, np.full((3, 2), 0.5)), ids(ops, [[3, 0], [1, 0], [0, 4]]))
    for draft in (dense, sparse):
        assert GreedyVerifier().verify(ops, draft, logits, GREEDY, None).token_ids == [3, 1, 4]


def test_greedy_verifier_refuses_sampling(ops):
    with pytest.raises(ValueError, match="speculative_sampling"):
        GreedyVerifier().verify(ops, None, f32(ops, one_hot_logits(BEST)[:1]), SAMPLE, np.random.default_rng(0))


def test_greedy_non_finite_rows(ops):
    logits = one_hot_logits(BEST)
    logits[2, 0] = np.nan  # row 2 is used only if drafts 0 and 1 are accepted
    assert GreedyVerifier().verify(ops, Draft(ids(ops, [0, 1, 4]), 3), f32(ops, logits), GREEDY, None).token_ids == [3]
    with pytest.raises(NonFiniteLogitsError, match="row 2 contain NaN"):
        GreedyVerifier().verify(ops, Draft(ids(ops, [3, 1, 4]), 3), f32(ops, logits), GREEDY, None)
    logits[0, 5] = np.inf
    with pytest.raises(NonFiniteLogitsError, match=r"row 0 contain \+inf"):
        GreedyVerifier().verify(ops, None, f32(ops, logits[:1]), GREEDY, None)
    with pytest.raises(NonFiniteLogitsError, match="mask every token"):
        GreedyVerifier().verify(ops, None, f32(ops, np.full((1, 6), -np.inf, dtype=np.float32)), GREEDY, None)


# -- processing ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_target_probs_match_reference(ops, temperature):
    logits = np.random.default_rng(11).normal(0.0, 1.5, size=(4, 10)).astype(np.float32)
    for top_k in (0, 1, 3, 9, 10, 20):
        for top_p in (0.3, 0.5, 0.9, 1.0):
            got = ops.to_numpy(target_probs(ops, f32(ops, logits), SamplingParams(temperature, top_p, top_k)))
            want = np.stack([reference_probs(row, temperature, top_k, top_p) for row in logits])
            np.testing.assert_allclose(got, want, atol=2e-6, err_msg=f"top_k={top_k} top_p={top_p}")
            assert got.dtype == np.float32


def test_processing_order_temperature_then_top_k_then_top_p(ops):
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.1]], dtype=np.float32))
    # top-k 2 renormalises to [4/7, 3/7] first, so top-p 0.5 keeps only the first token;
    # top-p before top-k would keep two.
    got = ops.to_numpy(target_probs(ops, f32(ops, logits), SamplingParams(1.0, 0.5, 2)))
    np.testing.assert_allclose(got, [[1.0, 0.0, 0.0, 0.0]], atol=1e-7)
    # Temperature is applied before top-p: flatter at T = 3, so top-p 0.5 keeps two tokens.
    hot = ops.to_numpy(target_probs(ops, f32(ops, logits), SamplingParams(3.0, 0.5, 0)))
    assert (hot[0] > 0).tolist() == [True, True, False, False]
    np.testing.assert_allclose(hot[0], reference_probs(logits[0], 3.0, 0, 0.5), atol=1e-6)


def test_a_top_p_below_float32s_smallest_keeps_the_most_likely_token(ops):
    """top_p = 5e-324 (the fuzzed server found it) is 0 in float32: the most likely token must still
    be kept, not every token dropped (a NaN row, read as non-finite logits)."""
    logits = np.random.default_rng(6).normal(size=(2, 7)).astype(np.float32)
    for top_p in (5e-324, 1e-40):
        p = ops.to_numpy(target_probs(ops, f32(ops, logits), SamplingParams(1.0, top_p, 0)))
        np.testing.assert_array_equal(p, np.eye(7, dtype=np.float32)[logits.argmax(-1)])


def test_top_k_one_at_positive_temperature_is_greedy(ops):
    logits = np.random.default_rng(5).normal(size=(3, 9)).astype(np.float32)
    p = ops.to_numpy(target_probs(ops, f32(ops, logits), SamplingParams(1.3, 1.0, 1)))
    np.testing.assert_array_equal(p, np.eye(9, dtype=np.float32)[logits.argmax(-1)])


def test_masked_tokens_get_zero_probability(ops):
    logits = np.array([[1.0, -np.inf, 2.0, -np.inf, 0.5]], dtype=np.float32)
    p = ops.to_numpy(target_probs(ops, f32(ops, logits), SamplingParams(0.7, 1.0, 4)))
    np.testing.assert_allclose(p[0], reference_probs(logits[0], 0.7), atol=1e-6)
    assert p[0, 1] == 0 and p[0, 3] == 0


def test_target_probs_refuses_temperature_zero(ops):
    with pytest.raises(ValueError, match="greedy"):
        target_probs(ops, f32(ops, [[0.0, 1.0]]), GREEDY)


def test_inverse_cdf_matches_the_distribution_on_a_uniform_grid(ops):
    p = np.array([0.0, 0.1, 0.0, 0.25, 0.4, 0.25, 0.0], dtype=np.float32)
    grid = (np.arange(20000) + 0.5) / 20000
    counts = np.zeros(p.size)
    picks = ops.to_numpy(inverse_cdf(ops, f32(ops, np.tile(p, (grid.size, 1))), f32(ops, grid[:, None])))
    np.add.at(counts, picks.astype(np.int64), 1)
    np.testing.assert_allclose(counts / grid.size, p, atol=1e-4)


def test_inverse_cdf_never_returns_a_token_without_mass(ops):
    p = np.array([[0.0, 0.0, 0.5, 0.5, 0.0, 0.0]], dtype=np.float32)
    low, high = 0.0, float(np.nextafter(1.0, 0.0))
    assert ops.to_list(inverse_cdf(ops, f32(ops, p), low)) == [2.0]
    assert ops.to_list(inverse_cdf(ops, f32(ops, p), high)) == [3.0]
    # Unnormalised rows, mass in the last token only, and float32 rounding near u = 1.
    rows = np.random.default_rng(3).random((200, 50)).astype(np.float32) * 1e-3
    rows[:, 40:] = 0.0
    rows[0, :] = 0.0
    rows[0, -1] = 7.0
    for u in (low, 0.5, 1 - 1e-7, high):
        picks = np.asarray(ops.to_list(inverse_cdf(ops, f32(ops, rows), u)), dtype=np.int64)
        assert picks.max() < 50 and (rows[np.arange(200), picks] > 0).all()


def test_sample_token_uses_one_host_uniform(ops):
    p = f32(ops, [0.0, 0.2, 0.0, 0.8])
    assert sample_token(ops, p, Uniforms([0.1])) == 1
    assert sample_token(ops, p, Uniforms([0.3])) == 3
    rng = np.random.default_rng(4)
    assert {sample_token(ops, p, rng) for _ in range(50)} == {1, 3}


# -- speculative sampling: edge cases ------------------------------------------------------

VOCAB = 6
LOGITS = np.random.default_rng(21).normal(0.0, 1.0, size=(4, VOCAB)).astype(np.float32)


def verify(ops, draft, logits, sampling, uniforms):
    rng = Uniforms(uniforms) if isinstance(uniforms, list) else uniforms
    return SpeculativeSamplingVerifier().verify(ops, draft, f32(ops, logits), sampling, rng)


def test_draft_with_zero_draft_probability_is_rejected(ops):
    q = np.full((1, VOCAB), 0.2, dtype=np.float32)
    q[0, 2] = 0.0  # the drafted token has q(x) = 0: a broken drafter; never accept it
    for u in (0.0, 0.5):
        result = verify(ops, Draft(ids(ops, [2]), 1, f32(ops, q)), LOGITS[:2], SAMPLE, [u, 0.5])
        assert result.accepted == 0 and result.token_ids[0] != 2


def test_draft_with_zero_target_probability_is_rejected_even_at_u_zero(ops):
    top1 = SamplingParams(1.0, 1.0, 1)  # p = one-hot at the argmax
    x = (int(LOGITS[0].argmax()) + 1) % VOCAB
    for draft in (Draft(ids(ops, [x]), 1), Draft(ids(ops, [x]), 1, f32(ops, np.full((1, VOCAB), 1 / VOCAB)))):
        result = verify(ops, draft, LOGITS[:2], top1, [0.0, 0.0])
        assert (result.accepted, result.token_ids) == (0, [int(LOGITS[0].argmax())])


def test_disjoint_supports_reject_everything_and_sample_the_target(ops):
    logits = np.array([[0.0, 0.0, 0.0, 0.0, 2.0, 2.5]] * 3, dtype=np.float32)
    sampling = SamplingParams(1.0, 1.0, 2)  # p on {4, 5}
    q = np.zeros((2, VOCAB), dtype=np.float32)
    q[:, :2] = 0.5  # q on {0, 1}
    rng = np.random.default_rng(8)
    seen = set()
    for _ in range(40):
        result = verify(ops, Draft(ids(ops, [0, 1]), 2, f32(ops, q)), logits, sampling, rng)
        assert result.accepted == 0 and len(result.token_ids) == 1
        seen.add(result.token_ids[0])
    assert seen == {4, 5}


def test_draft_equal_to_target_is_always_accepted(ops):
    sampling = SamplingParams(0.8, 0.9, 5)
    p = ops.to_numpy(target_probs(ops, f32(ops, LOGITS), sampling))
    rng = np.random.default_rng(9)
    for _ in range(20):
        x = [int(rng.choice(VOCAB, p=p[i] / p[i].sum())) for i in range(3)]
        draft = Draft(ids(ops, x), 3, f32(ops, p[:3]))
        result = verify(ops, draft, LOGITS, sampling, rng)
        assert result.accepted == 3 and result.token_ids[:3] == x and p[3, result.token_ids[3]] > 0


@pytest.mark.parametrize("vocab", [100, 8193])
def test_zero_residual_falls_back_to_the_target(ops, vocab):
    logits = np.full((2, vocab), -5.0, dtype=np.float32)
    logits[:, 7] = 9.0
    sampling = SamplingParams(1.0, 0.5, 3)  # p is one-hot at token 7
    p = ops.to_numpy(target_probs(ops, f32(ops, logits), sampling))
    q = (p[:1] * np.float32(1 + 1e-6)).astype(np.float32)  # q >= p everywhere: residual is all zero
    # u * q(7) >= p(7) for u close to 1, so the draft is rejected and the residual is empty.
    result = verify(ops, Draft(ids(ops, [7]), 1, f32(ops, q)), logits, sampling, [1 - 1e-9, 1 - 1e-9])
    assert result.accepted == 0 and result.token_ids == [7]
    # One-hot draft of the target's only token: always accepted, bonus from row 1.
    result = verify(ops, Draft(ids(ops, [7]), 1), logits, sampling, [1 - 1e-9, 1 - 1e-9])
    assert result.token_ids == [7, 7]


def test_one_hot_rejection_never_resamples_the_draft(ops):
    logits = np.array([[0.0, 1.0, 1.0, 0.5]], dtype=np.float32).repeat(2, axis=0)
    rng = np.random.default_rng(12)
    for _ in range(40):
        result = verify(ops, Draft(ids(ops, [1]), 1), logits, SAMPLE, rng)
        if result.accepted == 0:
            assert result.token_ids[0] != 1


def test_sparse_draft_probability_is_read_at_the_drafted_candidate(ops):
    sampling = SamplingParams(1.0)
    p = reference_probs(LOGITS[0], 1.0)
    x = 4
    candidates = ids(ops, [[1, x, 3]])
    q = f32(ops, [[0.2, 0.5, 0.3]])
    # Accept iff u * 0.5 < p(x): pick u just either side of the threshold.
    threshold = p[x] / 0.5
    below = verify(ops, Draft(ids(ops, [x]), 1, q, candidates), LOGITS[:2], sampling, [threshold * 0.999, 0.5])
    above = verify(ops, Draft(ids(ops, [x]), 1, q, candidates), LOGITS[:2], sampling, [min(threshold * 1.001, 0.999), 0.5])
    assert below.accepted == 1 and above.accepted == 0
    # A drafted id that is not a candidate has q(x) = 0: rejected.
    absent = verify(ops, Draft(ids(ops, [0]), 1, q, candidates), LOGITS[:2], sampling, [0.0, 0.5])
    assert absent.accepted == 0


def test_plain_sampling_without_draft(ops):
    sampling = SamplingParams(1.2, 0.9, 4)
    p = reference_probs(LOGITS[0], 1.2, 4, 0.9)
    cdf = np.cumsum(p)
    for u in (0.0, 0.2, 0.55, 0.9, 1 - 1e-9):
        result = verify(ops, None, LOGITS[:1], sampling, [u])
        assert result.accepted == 0 and result.token_ids == [int(np.searchsorted(cdf, u * cdf[-1], side="right"))]


def test_uniform_consumption_is_fixed_per_cycle(ops):
    rng = Uniforms([0.5] * 4)
    SpeculativeSamplingVerifier().verify(ops, Draft(ids(ops, [0, 1, 2]), 3), f32(ops, LOGITS), SAMPLE, rng)
    assert rng.used == 4  # k + 1, whatever was accepted
    rng = Uniforms([0.5])
    SpeculativeSamplingVerifier().verify(ops, None, f32(ops, LOGITS[:1]), SAMPLE, rng)
    assert rng.used == 1


# -- non-finite and masked rows ------------------------------------------------------------


def test_nan_logits_raise(ops):
    logits = LOGITS.copy()
    logits[0, 3] = np.nan
    with pytest.raises(NonFiniteLogitsError, match="row 0 contain NaN"):
        verify(ops, None, logits[:1], SAMPLE, np.random.default_rng(0))
    with pytest.raises(NonFiniteLogitsError, match="row 0 contain NaN"):
        verify(ops, Draft(ids(ops, [1, 2]), 2), logits[:3], SAMPLE, np.random.default_rng(0))


def test_non_finite_rows_raise_only_when_used(ops):
    sampling = SamplingParams(1.0)
    p = ops.to_numpy(target_probs(ops, f32(ops, LOGITS), sampling))
    logits = LOGITS.copy()
    logits[2, 1] = np.inf
    q = np.full((2, VOCAB), 0.0, dtype=np.float32)
    q[0] = p[0]  # row 0: q = p, always accepted
    q[1, 0] = 1.0  # row 1: q one-hot at 0 ...
    # ... drafted token 3 has q = 0 at row 1: rejected there, so row 2 (+inf) is never used.
    result = verify(ops, Draft(ids(ops, [2, 3]), 2, f32(ops, q)), logits[:3], sampling, [0.5, 0.5, 0.5])
    assert result.accepted == 1
    q[1] = p[1]  # now row 1 is accepted too and row 2 is needed for the bonus
    with pytest.raises(NonFiniteLogitsError, match=r"row 2 contain \+inf"):
        verify(ops, Draft(ids(ops, [2, 3]), 2, f32(ops, q)), logits[:3], sampling, [0.5, 0.5, 0.5])


def test_fully_masked_row_raises_and_partial_mask_is_fine(ops):
    logits = LOGITS[:2].copy()
    logits[0, :] = -np.inf
    with pytest.raises(NonFiniteLogitsError, match="mask every token"):
        verify(ops, Draft(ids(ops, [1]), 1), logits, SAMPLE, np.random.default_rng(0))
    logits[0, :4] = 1.0
    rng = np.random.default_rng(1)
    for _ in range(20):
        result = verify(ops, Draft(ids(ops, [5]), 1), logits, SAMPLE, rng)  # p(5) = 0: rejected
        assert result.accepted == 0 and result.token_ids[0] < 4


def test_temperature_overflow_raises(ops):
    logits = np.array([[3e38, 0.0, 1.0]], dtype=np.float32)
    with pytest.raises(NonFiniteLogitsError, match="temperature"):
        verify(ops, None, logits, SamplingParams(0.3), np.random.default_rng(0))


# -- contracts -----------------------------------------------------------------------------


def test_shape_errors_are_clear(ops):
    with pytest.raises(ValueError, match="rows"):
        verify(ops, Draft(ids(ops, [1, 2]), 2), LOGITS[:2], SAMPLE, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\[k, V\]"):
        verify(ops, Draft(ids(ops, [1]), 1, f32(ops, np.full((1, 4), 0.25))), LOGITS[:2], SAMPLE, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\[k, C\]"):
        draft = Draft(ids(ops, [1]), 1, f32(ops, [[0.5, 0.5]]), ids(ops, [[1, 2, 3]]))
        verify(ops, draft, LOGITS[:2], SAMPLE, np.random.default_rng(0))


def test_verifier_metadata():
    from speculant.core.types import ProposalKind

    assert GreedyVerifier.name == "greedy" and not GreedyVerifier.supports_sampling
    assert SpeculativeSamplingVerifier.name == "speculative_sampling" and SpeculativeSamplingVerifier.supports_sampling
    for cls in (GreedyVerifier, SpeculativeSamplingVerifier):
        assert set(cls.accepts) == set(ProposalKind)


def test_plugin_registers_both_verifiers():
    from speculant.verifiers import plugin

    registered = []
    plugin.register_verifiers(registered.append)
    assert {GreedyVerifier, SpeculativeSamplingVerifier} <= set(registered)


# -- batch and backend parity --------------------------------------------------------------


def random_cycles(kind: str, n: int, k: int, vocab: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 1.5, size=(n, k + 1, vocab)).astype(np.float32)
    if kind == "dense":
        q = rng.dirichlet(np.full(vocab, 0.7), size=(n, k)).astype(np.float32)
        x = np.array([[rng.choice(vocab, p=q[b, i] / q[b, i].sum()) for i in range(k)] for b in range(n)])
        return x, logits, q, None
    if kind == "sparse":
        cand = np.stack([np.stack([rng.permutation(vocab)[:3] for _ in range(k)]) for _ in range(n)])
        q = rng.dirichlet(np.ones(3), size=(n, k)).astype(np.float32)
        slot = np.array([[rng.choice(3, p=q[b, i] / q[b, i].sum()) for i in range(k)] for b in range(n)])
        return np.take_along_axis(cand, slot[..., None], -1)[..., 0], logits, q, cand
    return rng.integers(0, vocab, size=(n, k)), logits, None, None


def run_single(ops, cycles, sampling, seed):
    x, logits, q, cand = cycles
    rng = np.random.default_rng(seed)
    out = []
    for b in range(len(x)):
        draft = Draft(
            ids(ops, x[b]),
            x.shape[1],
            None if q is None else f32(ops, q[b]),
            None if cand is None else ids(ops, cand[b]),
        )
        out.append(SpeculativeSamplingVerifier().verify(ops, draft, f32(ops, logits[b]), sampling, rng))
    return out


@pytest.mark.parametrize("kind", ["one_hot", "dense", "sparse"])
def test_batch_matches_single_cycles(ops, kind):
    cycles = random_cycles(kind, 60, 3, seed=2)
    x, logits, q, cand = cycles
    sampling = SamplingParams(0.9, 0.95, 5)
    batch = acceptance.speculative_verify_batch(
        ops,
        ids(ops, x),
        f32(ops, logits),
        sampling,
        np.random.default_rng(7),
        None if q is None else f32(ops, q),
        None if cand is None else ids(ops, cand),
    )
    assert batch == run_single(ops, cycles, sampling, 7)
    assert len({v.accepted for v in batch}) >= 2


@pytest.mark.parametrize("kind", ["one_hot", "dense", "sparse"])
def test_backends_agree_token_for_token(ops, kind):
    if ops.name == "numpy":
        pytest.skip("the reference side of the comparison")
    cycles = random_cycles(kind, 40, 2, seed=5)
    for sampling in (SamplingParams(1.0), SamplingParams(0.6, 0.8, 4), GREEDY):
        assert run_single(ops, cycles, sampling, 3) == run_single(NumpyOps(), cycles, sampling, 3)
    rows = cycles[1][:, 0]
    for sampling in (SamplingParams(1.0), SamplingParams(1.7, 0.9, 3)):
        plain = [
            [SpeculativeSamplingVerifier().verify(o, None, f32(o, row[None]), sampling, rng) for row in rows]
            for o, rng in ((ops, np.random.default_rng(4)), (NumpyOps(), np.random.default_rng(4)))
        ]
        assert plain[0] == plain[1]

