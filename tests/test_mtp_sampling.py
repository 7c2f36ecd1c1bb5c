"""Sampling losslessness end to end with the MTP drafter (PyTorch, CPU, float32).

Each run generates 3 tokens from a fixed prompt, so the second token comes from a draft/verify
cycle (accepted draft or correction). The joint distribution of the first two tokens must be
plain sampling's: p(t1) p(t2 | t1) from the target's processed distributions (temperature,
top-p), computed exactly by target forwards. Chi-square goodness of fit over cells with an
expected count of at least 5 (the rest pooled per first token, and rare first tokens pooled);
the correct pipeline must give p > 1e-3, a deliberately broken one p < 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.core.interfaces import Drafter
from speculant.core.types import Draft, SamplingParams, Verification
from speculant.testing.tiny_mtp import bigram_mtp, build_bigram_target, mtp_tensors, write_mtp

pytest.importorskip("torch")
stats = pytest.importorskip("scipy.stats")
pytestmark = pytest.mark.slow

RUNS = 1200
SAMPLING = SamplingParams(temperature=1.0, top_p=0.9)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, torch_threads):
    """A soft bigram target (its mode has p ~ 0.66, the rest spread over ~300 tokens) and the exact
    token-path MTP, whose argmax draft is accepted a bit under half the time."""
    target, cycle = build_bigram_target(tmp_path_factory.mktemp("mtp_sampling") / "target", head_scale=0.8)
    write_mtp(target, mtp_tensors(bigram_mtp(target, cycle, path="token", block_scale=1.0), "qwen"), "qwen", 1)
    prompt = cycle[:4]
    engines = {}
    for name, options in (("one_hot", {}), ("dense", {"sample_drafts": True})):
        engines[name] = speculant.load_engine({
            "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
            "drafter": {"kind": "mtp", "block_size": 2, "options": options},
            "sampling": {"temperature": SAMPLING.temperature, "top_p": SAMPLING.top_p}})
    return {"engines": engines, "prompt": prompt, "cells": expected_cells(engines["one_hot"], prompt)}


def expected_cells(engine, prompt) -> dict:
    """Cell -> probability under plain sampling (exact, from the target's processed rows)."""
    from speculant.core.sampling import target_probs

    ops, target = engine.backend.ops, engine.target

    def row(ids):
        target.reset()
        return ops.to_numpy(target_probs(ops, target.prefill(ids).logits[-1:], SAMPLING))[0].astype(np.float64)

    p1 = row(prompt)
    cells: dict = {}
    for t1 in np.flatnonzero(p1 * RUNS >= 5):
        p2 = row(list(prompt) + [int(t1)])
        joint = p1[t1] * p2
        kept = np.flatnonzero(joint * RUNS >= 5)
        for t2 in kept:
            cells[(int(t1), int(t2))] = joint[t2]
        cells[(int(t1), "*")] = joint.sum() - joint[kept].sum()
    cells[("*", "*")] = 1.0 - sum(cells.values())
    return cells


def observed(engine, prompt, cells) -> tuple[np.ndarray, float]:
    counts = dict.fromkeys(cells, 0)
    accepted = 0
    for seed in range(RUNS):
        result = engine.run(prompt_ids=prompt, max_new_tokens=3, ignore_eos=True, seed=seed)
        t1, t2 = result.token_ids[:2]
        key = (t1, t2) if (t1, t2) in counts else (t1, "*") if (t1, "*") in counts else ("*", "*")
        counts[key] += 1
        accepted += result.stats.acceptance_lengths[0] - 1
    return np.array([counts[c] for c in cells], dtype=np.float64), accepted / RUNS


def p_value(counts, cells) -> float:
    expected = np.array(list(cells.values())) * RUNS
    keep = expected > 0
    return float(stats.chisquare(counts[keep], expected[keep] * counts.sum() / expected[keep].sum()).pvalue)


@pytest.mark.parametrize("name", ["one_hot", "dense"])
def test_first_two_tokens_follow_plain_sampling(setup, name):
    engine = setup["engines"][name]
    counts, acceptance = observed(engine, setup["prompt"], setup["cells"])
    assert 0.2 < acceptance < 0.9, acceptance  # both the accept and the correction paths are exercised
    assert len(setup["cells"]) >= 3
    assert p_value(counts, setup["cells"]) > 1e-3


class AlwaysAccept:
    """A lossy verifier (accepts every draft, then samples the bonus row): the test must notice."""

    name = "always_accept"

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, key):
        return getattr(self.inner, key)

    def verify(self, ops, draft, target_logits, sampling, rng):
        if draft is None:
            return self.inner.verify(ops, None, target_logits, sampling, rng)
        k = draft.num_tokens
        bonus = self.inner.verify(ops, None, target_logits[k:], sampling, rng).token_ids
        return Verification(k, [int(t) for t in ops.to_list(draft.token_ids)] + bonus)


class MisreportedQ(Drafter):
    """The real MTP drafter, sampling its drafts but reporting a uniform q (a drafter bug)."""

    def __init__(self, inner):
        self.inner, self.info = inner, inner.info

    def prefill(self, prompt_ids, output, first_token_id):
        self.inner.prefill(prompt_ids, output, first_token_id)

    def commit(self, output, num_rows, token_ids):
        self.inner.commit(output, num_rows, token_ids)

    def propose(self, request):
        draft = self.inner.propose(request)
        uniform = draft.draft_probs * 0 + 1.0 / draft.draft_probs.shape[-1]
        return Draft(draft.token_ids, draft.num_tokens, draft_probs=uniform)


@pytest.mark.parametrize("broken", ["always_accept", "misreported_q"])
def test_the_statistical_check_has_power(setup, broken):
    ok = setup["engines"]["one_hot" if broken == "always_accept" else "dense"]
    verifier = AlwaysAccept(ok.verifier) if broken == "always_accept" else ok.verifier
    drafter = MisreportedQ(ok.drafter) if broken == "misreported_q" else ok.drafter
    engine = speculant.Engine(ok.config, ok.backend, ok.target, verifier, drafter)
    counts, _ = observed(engine, setup["prompt"], setup["cells"])
    assert p_value(counts, setup["cells"]) < 1e-6
