"""Sampling stays lossless when the adaptive verifier changes the verify width every cycle.

Unit level: a first-order Markov target over 8 tokens and a drafter sampling from another table
(dense q, with its q(x) as confidence); the adaptive verifier drives the draft/verify loop as
the engine does, its state carried across trials, so widths vary with history, confidence,
fallback and probes. The joint law of the first three emitted tokens (of six) must match the target
chain (chi-square, p > 1e-3); a policy that peeks at the target before choosing the width
must be caught (p < 1e-6), which shows the test has power.

Engine level: the tiny planted pair at temperature 1 with top-k 3; the first two tokens of
many seeded runs must follow the target's exact two-token law.
"""

from __future__ import annotations

import numpy as np
import pytest

from speculant.core.arrays import NumpyOps
from speculant.core.types import CycleTiming, Draft, SamplingParams, Verification
from speculant.verifiers.adaptive import AdaptiveVerifier

scipy_stats = pytest.importorskip("scipy.stats")

V = 8
K = 5
TABLES = np.random.default_rng(11)
TARGET_LOGITS = TABLES.normal(0.0, 1.4, size=(V, V))
DRAFT_LOGITS = 0.7 * TARGET_LOGITS + TABLES.normal(0.0, 0.8, size=(V, V))
SAMPLING = SamplingParams(temperature=0.8)
COSTS = [1.0, 1.05, 1.1, 1.4, 1.45, 1.5]  # seconds per width 1..6: a small staircase


def softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


P = softmax(TARGET_LOGITS / SAMPLING.temperature)  # float64 reference of the target chain
Q = softmax(DRAFT_LOGITS)


def draft_chain(last, k, rng):
    tokens, rows = [], []
    for _ in range(k):
        row = Q[last]
        last = int(rng.choice(V, p=row))
        tokens.append(last)
        rows.append(row)
    probs = np.asarray(rows, dtype=np.float32)
    return Draft(np.asarray(tokens, dtype=np.int64), k, draft_probs=probs,
                 confidence=[float(probs[i, t]) for i, t in enumerate(tokens)])


def generate(verifier, trials, length=6, seed=0, cheat=False):
    """``trials`` sequences of ``length`` tokens after anchor 0; returns them and the widths."""
    ops, rng, verify_rng = NumpyOps(), np.random.default_rng(seed), np.random.default_rng(seed + 1)
    out, widths = np.zeros((trials, length), dtype=np.int64), []
    verifier.begin(1)
    for trial in range(trials):
        produced, last = [], 0
        while len(produced) < length:
            k = min(K, length - len(produced) - 1)
            ctx = 1 + len(produced) + 64 * trial
            draft, n, drafted = None, 0, 0
            if k > 0 and verifier.wants_draft(k, ctx):
                draft, drafted = draft_chain(last, k, rng), k
                n = verifier.plan(draft, k, ctx)
                if cheat:  # peeks at the target: verify only drafts the target likes more than q
                    first = int(draft.token_ids[0])
                    n = n if P[last, first] >= Q[last, first] else 0
                draft = draft.truncated(n, ops) if n > 0 else None
            rows = [last] + ([] if draft is None else [int(t) for t in draft.token_ids])
            logits = TARGET_LOGITS[rows].astype(np.float32)
            v = verifier.verify(ops, draft, logits, SAMPLING, verify_rng)
            verifier.observe(v, n, CycleTiming(ctx, n, drafted, COSTS[n], 0.3 if drafted else 0.0))
            widths.append(n)
            produced.extend(v.token_ids)
            last = produced[-1]
        out[trial] = produced[:length]
    return out, widths


def chi_square_pvalue(samples):
    index = samples[:, 0] * V * V + samples[:, 1] * V + samples[:, 2]
    observed = np.bincount(index, minlength=V ** 3).astype(float)
    expected = (P[0][:, None, None] * P[:, :, None] * P[None, :, :]).reshape(-1) * len(samples)
    small = expected < 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    return scipy_stats.chisquare(obs, exp).pvalue


class SteadyClock:
    """The verifier times its own host work, which the cost model learns from; under a loaded
    machine that changed the widths and so the (fixed-seed) sample. A steady clock keeps the
    unit test deterministic: each reading is 0.1 ms after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-4
        return self.now


@pytest.fixture
def steady_clock(monkeypatch):
    import speculant.verifiers.adaptive.verifier as adaptive

    monkeypatch.setattr(adaptive, "time", SteadyClock())


def test_sampling_is_lossless_with_widths_varying_per_cycle(steady_clock):
    verifier = AdaptiveVerifier({"hysteresis": 0.0, "probe_interval": 2, "max_probe_interval": 8, "refresh_interval": 5})
    samples, widths = generate(verifier, 8_000)
    counts = np.bincount(widths, minlength=K + 1)
    assert (counts > 100).sum() >= 4, counts  # plain steps and at least three different widths
    assert chi_square_pvalue(samples) > 1e-3


def cycle(verifier, draft, accepted_if_submitted, ctx=100):
    """One engine-like cycle; returns the width the verifier chose."""
    if not verifier.wants_draft(K, ctx):
        verifier.observe(Verification(0, [0]), 0, CycleTiming(ctx, 0, 0, COSTS[0], 0.0))
        return 0
    n = verifier.plan(draft, K, ctx)
    accepted = min(n, accepted_if_submitted)
    verifier.observe(Verification(accepted, [0] * (accepted + 1)), n, CycleTiming(ctx, n, K, COSTS[n], 0.01))
    return n


def test_a_sampled_drafts_own_confidence_never_chooses_its_width(steady_clock):
    """Verifying x_i only when its own q(x_i) is high biases the output (a sampled draft's
    confidence is a function of the token drawn), so sampled drafts are planned from history;
    an argmax draft's confidence (a function of the context) still steers the width."""
    tokens = np.arange(1, K + 1)
    probs = np.full((K, V), 1.0 / V, dtype=np.float32)
    widths = {}
    for kind in ("argmax", "sampled"):
        extra = {"draft_probs": probs} if kind == "sampled" else {}
        verifier = AdaptiveVerifier({"hysteresis": 0.0})
        verifier.begin(1)
        for i in range(300):  # confident drafts are accepted whole, unsure ones not at all
            confident = i % 2 == 0
            cycle(verifier, Draft(tokens, K, confidence=[0.95 if confident else 0.05] * K, **extra),
                  K if confident else 0)
        widths[kind] = {c: max(cycle(verifier, Draft(tokens, K, confidence=[c] * K, **extra), 0) for _ in range(3))
                        for c in (0.95, 0.05)}
    assert widths["argmax"][0.95] > widths["argmax"][0.05], widths
    assert widths["sampled"][0.95] == widths["sampled"][0.05], widths


def test_a_policy_that_peeks_at_the_target_is_detected(steady_clock):
    verifier = AdaptiveVerifier({"hysteresis": 0.0, "probe_interval": 2, "max_probe_interval": 8})
    samples, _ = generate(verifier, 4_000, seed=5, cheat=True)
    assert chi_square_pvalue(samples) < 1e-6


def test_engine_sampling_follows_the_target_with_adaptive_widths(planted_pair):
    import speculant
    from speculant.core.sampling import target_probs

    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
              "target": {"path": str(planted_pair["target"])},
              "drafter": {"kind": "dflash", "path": str(planted_pair["draft"])},
              "verifier": {"kind": "adaptive", "options": {"hysteresis": 0.0, "probe_interval": 2, "max_probe_interval": 4}},
              "sampling": {"temperature": 1.0, "top_k": 3}}
    eng = speculant.load_engine(config)
    sampling = SamplingParams(temperature=1.0, top_k=3)
    ops, prompt = eng.backend.ops, [160, 160, 5]

    def next_probs(ids):
        eng.target.reset()
        logits = eng.target.prefill(ids).logits[-1:]
        return ops.to_numpy(target_probs(ops, logits, sampling))[0].astype(np.float64)

    first = next_probs(prompt)
    support = np.flatnonzero(first > 0)
    joint = {(a, b): first[a] * p for a in support for b, p in enumerate(next_probs(prompt + [int(a)])) if p > 0}
    runs, widths = 400, []
    seen = []
    for seed in range(runs):
        result = eng.run(prompt_ids=prompt, max_new_tokens=4, seed=seed, ignore_eos=True)
        seen.append(tuple(result.token_ids[:2]))
        widths.append(result.stats.verifier["widths"][0])
    assert len(set(widths)) >= 2  # the first cycle's width varied across runs
    cells = sorted(joint)
    observed = np.array([seen.count(c) for c in cells], dtype=float)
    assert observed.sum() == runs  # nothing outside the target's support
    expected = np.array([joint[c] for c in cells]) * runs
    assert scipy_stats.chisquare(observed, expected / expected.sum() * runs).pvalue > 1e-3


def test_engine_drafts_sampled_cycles_only_as_long_as_they_submit(planted_pair):
    """Sampled drafts' widths come from history alone, so the adaptive verifier asks the drafter
    for that many tokens (``Verifier.draft_length``) rather than the whole block: the engine must
    pass it on, and no cycle may submit more than it drafted."""
    import speculant

    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
              "target": {"path": str(planted_pair["target"])},
              "drafter": {"kind": "dflash", "path": str(planted_pair["draft"]), "block_size": 8},
              "verifier": {"kind": "adaptive", "options": {"hysteresis": 0.0, "explore_every": 4}}}
    eng = speculant.load_engine(config)
    asked = []
    propose = eng.drafter.propose
    eng.drafter.propose = lambda request: asked.append(request.num_tokens) or propose(request)
    widths = []
    for seed in range(4):
        result = eng.run(prompt_ids=[160, 160, 5], max_new_tokens=48, temperature=1.0, seed=seed, ignore_eos=True)
        widths += [w for w in result.stats.verifier["widths"] if w > 0]
    assert min(asked) < 7 and max(asked) == 7, asked  # short drafts, and whole blocks to explore
    assert len(widths) <= len(asked) and sum(widths) <= sum(asked) and max(widths) <= 7, (widths, asked)
