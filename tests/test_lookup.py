"""Prompt lookup (``drafter.lookup``): copies of what followed an earlier occurrence of the
context's last tokens, verified by the target instead of a drafter proposal.

Unit level: what is copied (longest match, latest occurrence, loops continued past the end).
Engine level: greedy output equals plain decoding on PyTorch and MLX with the drafter skipped on
copy cycles; at temperature 1 the first two tokens follow the target's exact law when the
second comes from verifying a copy; config and validator errors name the field.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.core.config import ConfigError, EngineConfig
from speculant.core.lookup import PromptLookup
from speculant.api import validate


def lookup(history, min_match=2, max_match=4):
    p = PromptLookup(min_match, max_match)
    p.reset(history)
    return p


def test_copies_what_followed_the_latest_earlier_occurrence():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]).propose(3) == [8, 1, 2]
    assert lookup([1, 2, 3]).propose(3) is None  # no suffix occurred before
    assert lookup([5, 1, 2, 5, 1, 2]).propose(0) is None


def test_the_longest_matching_suffix_wins():
    # the 2-gram (3, 4) last occurred before 7, but the 3-gram (2, 3, 4) only before 6
    history = [2, 3, 4, 6, 0, 3, 4, 7, 0, 2, 3, 4]
    assert lookup(history, 2, 3).propose(1) == [6]
    assert lookup(history, 2, 2).propose(1) == [7]


def test_a_loop_continues_past_the_end_of_the_history():
    assert lookup([9, 4, 5, 6, 4, 5, 6]).propose(7) == [4, 5, 6, 4, 5, 6, 4]
    assert lookup([3, 3, 3], 1, 2).propose(4) == [3, 3, 3, 3]


def test_extend_keeps_the_index_current():
    p = lookup([1, 2, 3])
    p.extend([1, 2])
    assert p.propose(2) == [3, 1]
    p.reset([7, 8])
    assert p.history == [7, 8] and p.propose(2) is None
    with pytest.raises(ValueError, match="min_match <= max_match"):
        PromptLookup(5, 3)


# -- engine ------------------------------------------------------------------------------------
PROMPTS = {"short": [5, 6, 7], "repeats": [11, 12, 13, 14] * 4, "longer_than_window": list(range(20, 52))}


def config(kind, pair, drafter="draft", lookup=True, **extra):
    data = {"backend": {"kind": kind, "device": "cpu", "dtype": "float32"}, "target": {"path": str(pair["target"])}}
    if drafter is not None:
        data["drafter"] = {"kind": "dflash", "path": str(pair[drafter]), "lookup": lookup}
    return {**data, **extra}


@pytest.mark.parametrize("kind", ["torch", "mlx"])
@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_output_is_unchanged_and_copies_are_verified(planted_pair, kind, block_size):
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
    plain = speculant.load_engine(config(kind, planted_pair, drafter=None))
    spec = speculant.load_engine(config(kind, planted_pair))
    copies = 0
    for name, ids in PROMPTS.items():
        expected = plain.run(prompt_ids=ids, max_new_tokens=48, ignore_eos=True).token_ids
        result = spec.run(prompt_ids=ids, max_new_tokens=48, block_size=block_size, ignore_eos=True)
        assert result.token_ids == expected, name
        stats = result.stats
        assert stats.new_tokens == 48 == 1 + sum(stats.acceptance_lengths)
        assert 0 <= stats.lookup_steps <= stats.verify_steps
        copies += stats.lookup_steps
    assert copies > 0  # the repeating prompt alone guarantees copies


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_lookup_without_a_drafter_is_prompt_lookup_decoding(planted_pair, kind):
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
    plain = speculant.load_engine(config(kind, planted_pair, drafter=None))
    data = config(kind, planted_pair, drafter=None)
    data["drafter"] = {"lookup": True, "block_size": 6}
    copying = speculant.load_engine(data)
    assert copying.drafter.inner is None and copying.speculative and copying.block_size == 6  # lookup alone
    for name, ids in PROMPTS.items():
        expected = plain.run(prompt_ids=ids, max_new_tokens=48, ignore_eos=True).token_ids
        result = copying.run(prompt_ids=ids, max_new_tokens=48, ignore_eos=True)
        assert result.token_ids == expected, name
        stats = result.stats
        assert stats.new_tokens == 48 == 1 + sum(stats.acceptance_lengths)
        # a cycle without a match is a plain step (one token); a copy emits up to the block
        assert all(a == 1 for a in stats.acceptance_lengths) or stats.lookup_steps > 0
        assert max(stats.acceptance_lengths) <= 6
        if name == "repeats":
            assert stats.lookup_steps > 0 and stats.verify_steps < 47


def test_drafter_proposals_are_skipped_on_copy_cycles_and_stay_in_step(planted_pair):
    """The drafter is not asked on copy cycles but still commits them; its later proposals are
    as good as without lookup (its context is complete), and the copies beat it on the loop."""
    with_lookup = speculant.load_engine(config("torch", planted_pair))
    without = speculant.load_engine(config("torch", planted_pair, lookup=False))
    asked = []
    propose = with_lookup.drafter.propose
    with_lookup.drafter.propose = lambda request: asked.append(request.position) or propose(request)
    result = with_lookup.run(prompt_ids=PROMPTS["repeats"], max_new_tokens=64, ignore_eos=True)
    baseline = without.run(prompt_ids=PROMPTS["repeats"], max_new_tokens=64, ignore_eos=True)
    stats = result.stats
    assert result.token_ids == baseline.token_ids
    assert stats.lookup_steps > 0 and not set(asked) & copy_positions(result, PROMPTS["repeats"])
    # every cycle is a copy or a proposal, except a last one-token step (no room to draft)
    assert stats.verify_steps - 1 <= len(asked) + stats.lookup_steps <= stats.verify_steps
    assert stats.mean_acceptance_length >= baseline.stats.mean_acceptance_length


def copy_positions(result, prompt) -> set[int]:
    """Anchor positions of the cycles whose context suffix had occurred before (min_match 4)."""
    p, positions, position = PromptLookup(4, 8), set(), len(prompt)
    p.reset(prompt + result.token_ids[:1])
    for emitted in result.stats.acceptance_lengths:
        if p.propose(1) is not None:
            positions.add(position)
        new = result.token_ids[position - len(prompt) + 1: position - len(prompt) + 1 + emitted]
        p.extend(new)
        position += emitted
    return positions


def test_sampling_follows_the_target_when_a_copy_is_verified(planted_pair):
    """Every token of the vocabulary is in the prompt, so with one-token matches the first
    cycle after any first token verifies a copy; the first two tokens of many seeded runs must
    follow the target's two-token law (chi-square), as without lookup."""
    from speculant.core.types import SamplingParams
    from speculant.core.sampling import target_probs

    scipy_stats = pytest.importorskip("scipy.stats")

    data = config("torch", planted_pair, sampling={"temperature": 1.0, "top_k": 3})
    data["drafter"]["lookup"] = {"enabled": True, "min_match": 1, "max_match": 2}
    eng = speculant.load_engine(data)
    vocab = eng.target.info.vocab_size
    sampling = SamplingParams(temperature=1.0, top_k=3)
    ops, prompt = eng.backend.ops, list(range(vocab)) + [160, 160, 5]

    def next_probs(ids):
        eng.target.reset()
        logits = eng.target.prefill(ids).logits[-1:]
        return ops.to_numpy(target_probs(ops, logits, sampling))[0].astype(np.float64)

    first = next_probs(prompt)
    joint = {(a, b): first[a] * p for a in np.flatnonzero(first > 0)
             for b, p in enumerate(next_probs(prompt + [int(a)])) if p > 0}
    runs, seen = 400, []
    for seed in range(runs):
        result = eng.run(prompt_ids=prompt, max_new_tokens=3, seed=seed, ignore_eos=True)
        assert result.stats.lookup_steps >= 1
        seen.append(tuple(result.token_ids[:2]))
    cells = sorted(joint)
    observed = np.array([seen.count(c) for c in cells], dtype=float)
    assert observed.sum() == runs  # nothing outside the target's support
    expected = np.array([joint[c] for c in cells])
    assert scipy_stats.chisquare(observed, expected / expected.sum() * runs).pvalue > 1e-3


def test_lookup_config_switch_and_errors(planted_pair):
    assert EngineConfig.load(config("torch", planted_pair, lookup=True)).drafter.lookup.enabled
    assert not EngineConfig.load(config("torch", planted_pair, lookup=False)).drafter.lookup.enabled
    with pytest.raises(ConfigError, match="drafter.lookup.min_match"):
        EngineConfig.load(config("torch", planted_pair, lookup={"enabled": True, "min_match": 0}))
    report = validate(config("torch", planted_pair, lookup={"enabled": True, "min_match": 6, "max_match": 3}))
    [problem] = [p for p in report.errors if p.field == "drafter.lookup.min_match"]
    assert "exceeds max_match 3" in problem.message and "<=" in problem.fix
    alone = config("torch", planted_pair, drafter=None)
    alone["drafter"] = {"lookup": True, "block_size": 1}
    [problem] = validate(alone).errors
    assert problem.field == "drafter.block_size" and "copied" in problem.message


def test_copies_reach_the_verifier_marked_as_lookup_drafts(planted_pair):
    """One loop for every proposal: the verifier plans and observes copy cycles too, and can tell
    them apart (``DraftSource.LOOKUP``), as the adaptive width policy needs."""
    from speculant.core.types import DraftSource
    from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier

    class Recording(SpeculativeSamplingVerifier):
        def __init__(self):
            super().__init__()
            self.planned, self.observed = [], []

        def plan(self, draft, max_tokens, context_length):
            self.planned.append(draft.source)
            return super().plan(draft, max_tokens, context_length)

        def observe(self, verification, submitted, timing=None):
            self.observed.append(timing.source)

    base = speculant.load_engine(config("torch", planted_pair))
    verifier = Recording()
    engine = speculant.Engine(base.config, base.backend, base.target, verifier, base.drafter, base.report)
    stats = engine.run(prompt_ids=PROMPTS["repeats"], max_new_tokens=48, ignore_eos=True).stats
    copies = verifier.observed.count(DraftSource.LOOKUP)
    assert copies == stats.lookup_steps > 0 and verifier.planned.count(DraftSource.LOOKUP) == copies
    assert DraftSource.MODEL in verifier.planned and len(verifier.observed) == stats.verify_steps


def test_the_proposer_copies_first_then_asks_the_wrapped_drafter():
    from speculant.core.config import LookupConfig
    from speculant.core.types import Capture, Draft, DrafterInfo, DraftRequest, DraftSource
    from speculant.drafters.lookup import LookupProposer

    class Backend:  # the proposer needs only int_array from its backend
        def int_array(self, values):
            return np.asarray(values)

    class Inner:
        info = DrafterInfo(kind="inner", trained_block_size=4)
        commits: list = []

        def prefill(self, prompt_ids, output, first):
            self.commits.append(("prefill", list(prompt_ids), first))

        def propose(self, request):
            return Draft(np.asarray([0] * request.num_tokens), request.num_tokens)

        def commit(self, output, num_rows, token_ids):
            self.commits.append(("commit", list(token_ids)))

    inner = Inner()
    proposer = LookupProposer(inner, LookupConfig(enabled=True, min_match=2, max_match=3), Backend())
    assert proposer.info is inner.info
    proposer.prefill([1, 2, 3, 4], None, 1)  # context 1 2 3 4 1: no 2-gram repeats yet
    request = DraftRequest(anchor_id=1, position=4, num_tokens=3)
    assert proposer.propose_free(request) is None
    assert proposer.propose(request).source is DraftSource.MODEL
    proposer.commit(None, 1, [2])  # context ... 4 1 2: "1 2" occurred before 3
    copy = proposer.propose_free(DraftRequest(anchor_id=2, position=5, num_tokens=3))
    assert copy.source is DraftSource.LOOKUP and list(copy.token_ids) == [3, 4, 1]
    assert inner.commits == [("prefill", [1, 2, 3, 4], 1), ("commit", [2])]
    alone = LookupProposer(None, LookupConfig(enabled=True), Backend())
    alone.prefill([7, 8, 9], None, 6)
    assert alone.propose(DraftRequest(anchor_id=6, position=3, num_tokens=2)) is None
    assert alone.info.default_block_size == 8 and alone.info.capture == Capture()
