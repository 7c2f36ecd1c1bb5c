"""Sampling losslessness end to end on a tiny model: the first two tokens emitted by the
speculative engine (the second decided by a DFlash cycle with two drafts) follow the exact
joint distribution of plain sampling from the target, at T in {0.3, 1.0, 1.7} with top-k and
top-p (and T = 4, where a broken verifier shows). A verifier with a deliberately wrong residual (p instead of max(0, p - q)) fails."""

from __future__ import annotations

import numpy as np
import pytest
from stats_helpers import gof_pvalue, reference_probs

import speculant
from speculant.verifiers import acceptance

torch = pytest.importorskip("torch")

PROMPT = [5, 6, 7]
RUNS = 1500
SETTINGS = {0.3: (0.3, 1.0, 4), 1.0: (1.0, 0.9, 4), 1.7: (1.7, 0.95, 3), 4.0: (4.0, 1.0, 6)}
# At T = 4 the drafted token has intermediate target probability in many contexts, which is
# where a wrong residual shows (the planted target is nearly deterministic at low T).
POWERFUL = 4.0


@pytest.fixture(scope="module")
def engine(planted_pair):
    return speculant.load_engine({
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
        "target": {"path": str(planted_pair["target"])},
        "drafter": {"kind": "dflash", "path": str(planted_pair["draft"])},
    })


def exact_joint(model, temperature, top_p, top_k) -> np.ndarray:
    """P(x1, x2) of plain sampling, from the target's own logits (float64 processing)."""
    with torch.no_grad():
        first = model(torch.tensor([PROMPT])).logits[0, -1].numpy()
        p1 = reference_probs(first, temperature, top_k, top_p)
        joint = np.zeros((p1.size, p1.size))
        for x1 in np.flatnonzero(p1):
            logits = model(torch.tensor([PROMPT + [int(x1)]])).logits[0, -1].numpy()
            joint[x1] = p1[x1] * reference_probs(logits, temperature, top_k, top_p)
    return joint


def sampled_pairs(engine, temperature, top_p, top_k) -> tuple[np.ndarray, int]:
    pairs, drafted_cycles = [], 0
    for seed in range(RUNS):
        result = engine.run(prompt_ids=PROMPT, max_new_tokens=3, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, ignore_eos=True, block_size=3)
        pairs.append(result.token_ids[0] * engine.target.info.vocab_size + result.token_ids[1])
        drafted_cycles += result.stats.acceptance_lengths[0] > 1
    return np.asarray(pairs), drafted_cycles


@pytest.mark.parametrize("temperature", sorted(SETTINGS))
def test_speculative_sampling_matches_plain_sampling(engine, temperature):
    t, top_p, top_k = SETTINGS[temperature]
    joint = exact_joint(engine.target.model, t, top_p, top_k)
    pairs, accepted_cycles = sampled_pairs(engine, t, top_p, top_k)
    assert gof_pvalue(pairs, joint) > 1e-3
    assert accepted_cycles > RUNS * 0.05  # drafts were really accepted, so the verifier was exercised


def test_a_broken_residual_is_detected(engine, monkeypatch):
    monkeypatch.setattr(acceptance, "residual", lambda ops, target, draft_full: target)
    t, top_p, top_k = SETTINGS[POWERFUL]
    joint = exact_joint(engine.target.model, t, top_p, top_k)
    pairs, _ = sampled_pairs(engine, t, top_p, top_k)
    assert gof_pvalue(pairs, joint) < 1e-6
