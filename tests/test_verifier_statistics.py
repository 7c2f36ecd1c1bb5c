"""Statistical losslessness of speculative sampling, with proof that the test has power.

Target and drafter are first-order Markov tables over V = 8 tokens: row ``prev`` of the
target logits is the target's next-token distribution after ``prev``; drafts are sampled
token by token from the drafter's table (argmax for one-hot drafts). From a fixed anchor,
the first emitted token must follow the processed target row p(. | anchor) and the first
two emitted tokens p(y | anchor) p(z | y) -- the second either from the same cycle
(accepted draft, correction or bonus) or from a second cycle anchored at the first token.
Chi-square goodness of fit at fixed seeds: the correct verifier must give p > 1e-3, each
deliberately broken verifier p < 1e-6.

Cycles are run in batches through ``speculative_verify_batch``, the function every single
``verify`` call goes through (test_verifiers checks batch == single calls token for token).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import numpy as np
import pytest

from speculant.core.arrays import NumpyOps
from stats_helpers import reference_probs, chi2_sf, gof_pvalue
from speculant.core.types import SamplingParams
from speculant.core import sampling as sampling_math
from speculant.verifiers import acceptance

VOCAB = 8
CANDIDATES = 4
ANCHOR = 0
TRIALS = 20_000
TABLES = np.random.default_rng(2024)
TARGET_LOGITS = TABLES.normal(0.0, 1.3, size=(VOCAB, VOCAB)).astype(np.float32)
DRAFT_LOGITS = (0.6 * TARGET_LOGITS + TABLES.normal(0.0, 1.0, size=(VOCAB, VOCAB))).astype(np.float32)
OTHER_LOGITS = TABLES.normal(0.0, 1.0, size=(VOCAB, VOCAB)).astype(np.float32)

SAMPLINGS = {
    0.3: SamplingParams(0.3, 0.97, 5),
    1.0: SamplingParams(1.0, 0.9, 6),
    1.7: SamplingParams(1.7, 0.85, 5),
}


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




def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


# -- the drafter: dense, sparse (candidate ids + q over them) and one-hot tables -------------

DENSE_Q = softmax(DRAFT_LOGITS.astype(np.float64)).astype(np.float32)
SPARSE_IDS = np.argsort(-DRAFT_LOGITS, axis=-1, kind="stable")[:, :CANDIDATES]
SPARSE_Q = softmax(np.take_along_axis(DRAFT_LOGITS, SPARSE_IDS, -1).astype(np.float64)).astype(np.float32)
# A different distribution over the same candidates, for broken variant (d).
SPARSE_Q_OTHER = softmax(np.take_along_axis(OTHER_LOGITS, SPARSE_IDS, -1).astype(np.float64)).astype(np.float32)


def sample_rows(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row of a float32 probability table (vectorised inverse CDF)."""
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    u = rng.random(len(probs))[:, None] * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(-1), probs.shape[-1] - 1)


def draft_chain(kind: str, anchors: np.ndarray, k: int, rng: np.random.Generator, mismatched_q: bool = False):
    """k drafts per anchor, each conditioned on the previous token: (x, draft_probs, candidate_ids)."""
    prev = anchors
    xs, qs, cands = [], [], []
    for _ in range(k):
        if kind == "one_hot":
            x = DRAFT_LOGITS[prev].argmax(-1)
        elif kind == "dense":
            qs.append(DENSE_Q[prev])
            x = sample_rows(DENSE_Q[prev], rng)
        else:
            slot = sample_rows(SPARSE_Q[prev], rng)
            x = SPARSE_IDS[prev, slot]
            qs.append((SPARSE_Q_OTHER if mismatched_q else SPARSE_Q)[prev])
            cands.append(SPARSE_IDS[prev])
        xs.append(x)
        prev = x
    stack = lambda a: np.stack(a, axis=1) if a else None  # noqa: E731
    return stack(xs), stack(qs), stack(cands)


def run_cycles(ops, kind, anchors, k, sampling, rng, mismatched_q=False):
    x, q, cand = draft_chain(kind, anchors, k, rng, mismatched_q)
    rows = TARGET_LOGITS[np.concatenate([anchors[:, None], x], axis=1)]
    return acceptance.speculative_verify_batch(
        ops,
        ops.asarray(x, dtype="int64"),
        ops.asarray(rows),
        sampling,
        rng,
        None if q is None else ops.asarray(q),
        None if cand is None else ops.asarray(cand, dtype="int64"),
    )


def emitted_first_two(ops, kind, k, sampling, seed, trials=TRIALS, mismatched_q=False):
    """First and second emitted token of ``trials`` independent generations from ANCHOR."""
    rng = np.random.default_rng(seed)
    first = run_cycles(ops, kind, np.full(trials, ANCHOR), k, sampling, rng, mismatched_q)
    tokens = np.array([v.token_ids[0] for v in first])
    second = np.array([v.token_ids[1] if len(v.token_ids) > 1 else -1 for v in first])
    pending = np.flatnonzero(second < 0)
    if pending.size:
        more = run_cycles(ops, kind, tokens[pending], k, sampling, rng, mismatched_q)
        second[pending] = [v.token_ids[0] for v in more]
    return tokens, second


def expected(sampling: SamplingParams):
    table = np.stack([reference_probs(row, sampling.temperature, sampling.top_k, sampling.top_p) for row in TARGET_LOGITS])
    first = table[ANCHOR]
    return first, first[:, None] * table


# -- chi-square goodness of fit ------------------------------------------------------------






def pvalues(ops, kind, k, sampling, seed, **kwargs) -> tuple[float, float]:
    first, second = emitted_first_two(ops, kind, k, sampling, seed, **kwargs)
    p_first, p_pair = expected(sampling)
    return gof_pvalue(first, p_first), gof_pvalue(first * VOCAB + second, p_pair)


def test_chi2_survival_function():
    assert math.isclose(chi2_sf(3.84145882, 1), 0.05, rel_tol=1e-6)
    assert math.isclose(chi2_sf(2.0, 2), math.exp(-1.0), rel_tol=1e-12)
    assert math.isclose(chi2_sf(124.342, 100), 0.05, rel_tol=1e-3)
    scipy_stats = pytest.importorskip("scipy.stats")
    for stat, df in [(0.5, 1), (7.0, 3), (40.0, 7), (63.0, 63), (150.0, 50), (1e-3, 10)]:
        assert math.isclose(chi2_sf(stat, df), scipy_stats.chi2.sf(stat, df), rel_tol=1e-9, abs_tol=1e-300)


def test_tables_exercise_the_filters():
    """Top-k and top-p both remove tokens from every target row, and most rows keep several."""
    for sampling in SAMPLINGS.values():
        kept = [(reference_probs(row, sampling.temperature, sampling.top_k, sampling.top_p) > 0).sum() for row in TARGET_LOGITS]
        no_top_p = [(reference_probs(row, sampling.temperature, sampling.top_k) > 0).sum() for row in TARGET_LOGITS]
        assert max(kept) < VOCAB and sum(kept) >= 2 * VOCAB and sum(kept) < sum(no_top_p) == sampling.top_k * VOCAB


# -- the correct verifier ------------------------------------------------------------------

CASES = [(kind, k, [0.3, 1.0, 1.7][(i + k) % 3]) for i, kind in enumerate(["one_hot", "dense", "sparse"]) for k in (1, 2, 3)]


@pytest.mark.parametrize("kind, k, temperature", CASES)
def test_speculative_sampling_is_lossless(kind, k, temperature):
    p_first, p_pair = pvalues(NumpyOps(), kind, k, SAMPLINGS[temperature], seed=100 + k)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


@pytest.mark.parametrize("backend, kind", [("torch", "sparse"), ("torch", "one_hot"), ("mlx", "dense")])
def test_speculative_sampling_is_lossless_on_other_backends(backend, kind):
    p_first, p_pair = pvalues(make_ops(backend), kind, 2, SAMPLINGS[1.7], seed=7, trials=10_000)
    assert p_first > 1e-3 and p_pair > 1e-3, (p_first, p_pair)


def test_plain_sampling_follows_the_target():
    from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier

    ops, sampling = NumpyOps(), SAMPLINGS[1.0]
    rng = np.random.default_rng(3)
    row = ops.asarray(TARGET_LOGITS[ANCHOR][None])
    tokens = np.array([SpeculativeSamplingVerifier().verify(ops, None, row, sampling, rng).token_ids[0] for _ in range(4000)])
    assert gof_pvalue(tokens, expected(sampling)[0]) > 1e-3


# -- broken verifiers must be caught -------------------------------------------------------


def residual_is_target(ops, target, draft_full):
    return target  # (a) forgets to subtract q


def accept_with_q_over_p(target_prob, draft_prob, u):
    return u * target_prob < draft_prob  # (b) min(1, q/p) instead of min(1, p/q)


def probs_without_top_k(ops, logits, sampling):
    return sampling_math.target_probs(ops, logits, replace(sampling, top_k=0))  # (c) top-k not applied to p


def subtract_q_at_draft_only(ops, x, draft_probs, candidate_ids, shape):
    full = REAL_DRAFT_ROWS(ops, x, draft_probs, candidate_ids, shape)  # (e) residual p - q(x) e_x
    at_x = ops.scatter_add(ops.full(full.shape, 0.0), x[:, None], ops.full((full.shape[0], 1), 1.0))
    return full * at_x


REAL_DRAFT_ROWS = acceptance.draft_rows

# Each broken case is one of CASES: same tables, seed and trials, which the correct verifier
# passes in test_speculative_sampling_is_lossless.
BROKEN = [
    ("residual_is_p", "residual", residual_is_target, "one_hot", 1, 1.0),
    ("residual_is_p", "residual", residual_is_target, "dense", 1, 1.7),
    ("residual_is_p", "residual", residual_is_target, "sparse", 2, 1.0),
    ("accept_q_over_p", "accept_draft", accept_with_q_over_p, "one_hot", 1, 1.0),
    ("accept_q_over_p", "accept_draft", accept_with_q_over_p, "dense", 2, 0.3),
    ("p_before_top_k", "target_probs", probs_without_top_k, "dense", 1, 1.7),
    ("p_before_top_k", "target_probs", probs_without_top_k, "one_hot", 2, 1.7),
    ("residual_only_at_x", "draft_rows", subtract_q_at_draft_only, "dense", 3, 1.0),
]


@pytest.mark.parametrize("name, attribute, broken, kind, k, temperature", BROKEN, ids=[f"{b[0]}-{b[3]}" for b in BROKEN])
def test_broken_verifiers_are_detected(monkeypatch, name, attribute, broken, kind, k, temperature):
    assert (kind, k, temperature) in CASES
    monkeypatch.setattr(acceptance, attribute, broken)
    p_first, p_pair = pvalues(NumpyOps(), kind, k, SAMPLINGS[temperature], seed=100 + k)
    assert min(p_first, p_pair) < 1e-6, (p_first, p_pair)


@pytest.mark.parametrize("k, temperature", [(1, 0.3), (2, 1.0)])
def test_sparse_q_from_another_distribution_is_detected(k, temperature):
    assert ("sparse", k, temperature) in CASES
    p_first, p_pair = pvalues(NumpyOps(), "sparse", k, SAMPLINGS[temperature], seed=100 + k, mismatched_q=True)
    assert min(p_first, p_pair) < 1e-6, (p_first, p_pair)
