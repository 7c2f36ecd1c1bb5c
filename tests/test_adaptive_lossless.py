"""The adaptive verifier never changes the output: greedy runs equal plain decoding token for
token (the spine's greedy catalogue), the width is decided before the target forward from
draft-side information only, and the drafter's context stays complete when cycles skip drafting.
"""

from __future__ import annotations

import inspect
import typing
from collections import Counter

import pytest

import speculant
from speculant.core.interfaces import Verifier
from speculant.core.types import Capture, DraftRequest
from speculant.verifiers.adaptive import AdaptivePolicy, AdaptiveVerifier
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier

PROMPTS = {
    "one_token": [5],
    "short": [5, 6, 7],
    "longer_than_window": list(range(20, 52)),  # 32 tokens > the sliding draft's window of 8
}
# Staircase costs, no hysteresis and short probe intervals: widths change from cycle to cycle,
# with plain steps (fallback, probes, refreshes) mixed in.
VARIED = {"cost_table": [1.0, 1.02, 1.04, 1.3, 1.32, 1.34, 1.36, 1.9, 1.92, 1.94, 1.96, 2.5, 2.6, 2.7, 2.8, 2.9],
          "draft_cost": 0.35, "hysteresis": 0.0, "probe_interval": 2, "max_probe_interval": 4, "refresh_interval": 3,
          "prior_acceptance": 0.6}


def engine(target, draft=None, verifier=None, **drafter):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": "dflash", "path": str(draft), **drafter}
    if verifier is not None:
        config["verifier"] = {"kind": "adaptive", "options": verifier}
    return speculant.load_engine(config)


def share(base, verifier):
    """Another engine over the same loaded target and drafter, with a different verifier."""
    return speculant.Engine(base.config, base.backend, base.target, verifier, base.drafter, base.report)


@pytest.fixture(scope="module")
def engines(planted_pair):
    measured = engine(planted_pair["target"], planted_pair["draft"], verifier={})
    swa = engine(planted_pair["target"], planted_pair["draft_swa"], verifier={})
    return {
        "plain": engine(planted_pair["target"]),
        ("dflash", "measured"): measured,
        ("dflash", "varied"): share(measured, AdaptiveVerifier(VARIED)),
        ("dflash_swa", "measured"): swa,
        ("dflash_swa", "varied"): share(swa, AdaptiveVerifier(VARIED)),
    }


@pytest.fixture(scope="module")
def plain_runs(engines):
    cache = {}

    def run(prompt, n, **kw):
        key = (tuple(prompt), n, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = engines["plain"].run(prompt_ids=prompt, max_new_tokens=n, **kw).token_ids
        return cache[key]

    return run


WIDTHS: Counter = Counter()
ACTIONS: Counter = Counter()


@pytest.mark.parametrize("policy", ["measured", "varied"])
@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("drafter", ["dflash", "dflash_swa"])
def test_greedy_adaptive_equals_plain(engines, plain_runs, prompt, block_size, drafter, policy):
    ids = PROMPTS[prompt]
    expected = plain_runs(ids, 40, ignore_eos=True)
    result = engines[drafter, policy].run(prompt_ids=ids, max_new_tokens=40, block_size=block_size, ignore_eos=True)
    assert result.token_ids == expected
    stats = result.stats
    assert stats.new_tokens == 40 == 1 + sum(stats.acceptance_lengths)
    decisions = stats.verifier
    assert decisions["policy"] == "adaptive" and len(decisions["widths"]) == stats.verify_steps
    assert all(0 <= w <= block_size - 1 for w in decisions["widths"])
    WIDTHS.update(decisions["widths"])
    ACTIONS.update(decisions["actions"])


def test_the_catalogue_exercised_varying_widths_and_fallback():
    if not WIDTHS:
        pytest.skip("run together with test_greedy_adaptive_equals_plain")
    assert len([w for w in WIDTHS if w > 0]) >= 6  # many different widths were verified
    assert WIDTHS[0] >= 20 and ACTIONS["probe"] >= 5
    assert {"plain:cost", "plain:refresh", "speculate"} <= set(ACTIONS)


@pytest.mark.parametrize("max_new", [1, 2, 5, 13, 31])
def test_max_new_tokens_inside_a_block(engines, plain_runs, max_new):
    expected = plain_runs(PROMPTS["short"], max_new, ignore_eos=True)
    for policy in ("measured", "varied"):
        result = engines["dflash", policy].run(prompt_ids=PROMPTS["short"], max_new_tokens=max_new, block_size=8, ignore_eos=True)
        assert result.token_ids == expected and len(expected) == max_new


def test_stop_token_inside_a_block(engines, plain_runs):
    reference = plain_runs(PROMPTS["short"], 40, ignore_eos=True)
    stop = next(t for i, t in enumerate(reference) if i >= 4 and t not in reference[:i])
    cut = reference.index(stop) + 1
    for block in (4, 16):
        for policy in ("measured", "varied"):
            result = engines["dflash", policy].run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=block,
                                                   stop_token_ids=[stop], ignore_eos=True)
            assert result.token_ids == reference[:cut]
            assert result.stats.stop_reason == "eos"


def test_eos_from_target_config_stops(engines, plain_runs):
    expected = plain_runs(PROMPTS["short"], 40)
    for policy in ("measured", "varied"):
        assert engines["dflash", policy].run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=8).token_ids == expected


def test_random_draft_still_lossless_and_falls_back(random_pair):
    plain = engine(random_pair["target"]).run(prompt_ids=[9, 8, 7], max_new_tokens=60, ignore_eos=True)
    spec = engine(random_pair["target"], random_pair["draft"], verifier={})
    for _ in range(2):
        result = spec.run(prompt_ids=[9, 8, 7], max_new_tokens=60, ignore_eos=True)
        assert result.token_ids == plain.token_ids
    assert result.stats.verifier["fallback_cycles"].get("cost", 0) >= 30


# -- information flow: the width is decided before the target forward, from draft-side data ----

def test_policy_inputs_cannot_include_target_output():
    hints = typing.get_type_hints(AdaptivePolicy.plan)
    assert list(inspect.signature(AdaptivePolicy.plan).parameters) == [
        "self", "num_drafted", "max_tokens", "context_length", "confidence"]
    assert hints["num_drafted"] is int and hints["max_tokens"] is int and hints["context_length"] is int
    assert list(inspect.signature(AdaptivePolicy.wants_draft).parameters) == ["self", "max_tokens", "context_length"]
    assert list(inspect.signature(AdaptiveVerifier.plan).parameters) == list(inspect.signature(Verifier.plan).parameters)
    assert list(inspect.signature(Verifier.plan).parameters) == ["self", "draft", "max_tokens", "context_length"]
    # what observe learns from is a finished cycle: counts, timings and the host token ids it
    # committed (the repeat hint), never arrays; it runs after the cycle's verification
    observe = inspect.signature(AdaptivePolicy.observe).parameters
    assert list(observe) == ["self", "submitted", "accepted", "timing", "verify_s", "token_ids"]


class Recorder:
    """Wraps the target's forward and the verifier's hooks; logs the order of events."""

    def __init__(self, eng):
        self.events = []
        target, verifier, drafter = eng.target, eng.verifier, eng.drafter
        self._wrap(target, "forward", lambda args: ("forward", target.cache_length))
        self._wrap(target, "forward_tree", lambda args: ("forward", target.cache_length))  # a tree cycle's
        self._wrap(drafter, "propose", lambda args: ("propose", args[0].position))
        self._wrap(drafter, "commit", lambda args: ("commit", args[1]))
        self._wrap(verifier, "wants_draft", lambda args: ("wants_draft", args[1]))
        self._wrap(verifier, "plan", lambda args: ("plan", args[2], target.cache_length, args[0]))
        self._wrap(verifier, "verify", lambda args: ("verify",))
        self._wrap(verifier, "verify_tree", lambda args: ("verify",))
        self._wrap(verifier, "observe", lambda args: ("observe", args[1]))

    def _wrap(self, obj, name, describe):
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            self.events.append(describe(args))
            return original(*args, **kwargs)

        setattr(obj, name, wrapper)


def test_plan_runs_before_the_target_forward_of_its_cycle(planted_pair):
    eng = engine(planted_pair["target"], planted_pair["draft"], verifier=VARIED)
    rec = Recorder(eng)
    result = eng.run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=8, ignore_eos=True)
    kinds = [e[0] for e in rec.events]
    assert kinds.count("observe") == result.stats.verify_steps
    cycles, current = [], []
    for event in rec.events[1:]:  # events[0] is the first token's verify after prefill
        current.append(event)
        if event[0] == "observe":
            cycles.append(current)
            current = []
    assert len(cycles) == result.stats.verify_steps
    planned = 0
    for cycle in cycles:
        names = [e[0] for e in cycle]
        assert names.count("forward") == 1 and names[-3:] == ["verify", "commit", "observe"]
        forward = names.index("forward")
        if "plan" in names:
            planned += 1
            plan = cycle[names.index("plan")]
            assert names.index("plan") < forward and names.index("propose") < names.index("plan")
            assert plan[2] == plan[1]  # the target cache holds only committed tokens when planning
            # the draft, with only the drafter's own per-position logits (made before the target's forward)
            assert plan[3] is not None and tuple(plan[3].logits.shape)[0] == plan[3].num_tokens
        if "propose" in names:
            assert names.index("wants_draft") < names.index("propose")
        else:
            assert "plan" not in names  # a cycle without a draft is a plain step
    assert planned >= 5 and planned < len(cycles)  # some cycles drafted, some skipped drafting


class Alternating(SpeculativeSamplingVerifier):
    """Drafts every other cycle, so the drafter sees commits without proposals in between."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def wants_draft(self, max_tokens, context_length):
        self.calls += 1
        return self.calls % 3 != 0


def test_drafter_context_stays_complete_when_cycles_skip_drafting(planted_pair):
    base = engine(planted_pair["target"], planted_pair["draft"])
    eng = share(base, Alternating())
    proposals = []
    original = eng.drafter.propose

    def record(request):
        draft = original(request)
        proposals.append((request.position, request.anchor_id, request.num_tokens, draft.token_ids.tolist()))
        return draft

    eng.drafter.propose = record
    prompt = PROMPTS["longer_than_window"]
    result = eng.run(prompt_ids=prompt, max_new_tokens=40, block_size=8, ignore_eos=True)
    del eng.drafter.propose
    sequence = prompt + result.token_ids
    assert result.stats.verify_steps > len(proposals) >= 5
    # a fresh drafter given the same committed context in one piece proposes the same tokens
    target, drafter, capture = base.target, base.drafter, base.drafter.info.capture
    for position, anchor, k, tokens in proposals[1:]:
        assert sequence[position] == anchor
        target.reset()
        out = target.prefill(sequence[:position], capture)
        drafter.prefill(sequence[:position], out, anchor)
        fresh = drafter.propose(DraftRequest(anchor, position, k))
        assert fresh.token_ids.tolist() == tokens


def test_max_context_decodes_plainly_and_stops_feeding_the_drafter(engines, plain_runs, planted_pair):
    prompt = PROMPTS["short"]
    expected = plain_runs(prompt, 40, ignore_eos=True)
    eng = engine(planted_pair["target"], planted_pair["draft"], verifier={"max_context": 20})
    rec = Recorder(eng)
    result = eng.run(prompt_ids=prompt, max_new_tokens=40, block_size=8, ignore_eos=True)
    assert result.token_ids == expected
    d = result.stats.verifier
    assert 20 <= d["plain_from_context"] < 28 and d["max_context"] == 20
    positions = [e[1] for e in rec.events if e[0] == "propose"]
    assert positions and max(positions) < 20
    commits = [i for i, e in enumerate(rec.events) if e[0] == "commit"]
    forwards = [e[1] for e in rec.events if e[0] == "forward"]
    assert len(commits) < len(forwards)  # no commits once plain
    assert all(w == 0 for w in d["widths"][-10:])
    # a prompt already past max_context: no drafter call at all, no captured features
    rec.events.clear()
    captures = []
    forward = eng.target.forward

    def spy(ids, capture=Capture()):
        captures.append(capture)
        return forward(ids, capture)

    eng.target.forward = spy
    long_prompt = list(range(20, 45))
    result = eng.run(prompt_ids=long_prompt, max_new_tokens=12, block_size=8, ignore_eos=True)
    assert result.token_ids == plain_runs(long_prompt, 12, ignore_eos=True)
    assert not [e for e in rec.events if e[0] in ("propose", "commit", "wants_draft", "plan")]
    assert all(not c for c in captures)
    assert result.stats.verifier["plain_from_context"] == len(long_prompt)


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2_pair

    target, draft = build_tiny_dflash2_pair(tmp_path_factory.mktemp("adaptive_dflash2"), block_size=8, sliding_window=8)
    return target, draft


def test_dflash2_confidence_reaches_the_policy_and_greedy_stays_identical(dflash2_pair):
    target, draft = dflash2_pair
    base = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    plain = speculant.load_engine(base)
    eng = speculant.load_engine({**base, "drafter": {"kind": "dflash2", "path": str(draft)},
                                        "verifier": {"kind": "adaptive", "options": VARIED}})
    for prompt in PROMPTS.values():
        expected = plain.run(prompt_ids=prompt, max_new_tokens=40, ignore_eos=True).token_ids
        assert eng.run(prompt_ids=prompt, max_new_tokens=40, ignore_eos=True).token_ids == expected
    calibration = eng.verifier.policy.acceptance
    assert sum(calibration.bin_n) > 0  # the walk's per-token probabilities were calibrated
    # sampled DFlash2 rounds propose sparse q over candidate ids; the adaptive verifier takes them
    result = eng.run(prompt_ids=PROMPTS["short"], max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    assert result.stats.new_tokens == 30 and any(w > 0 for w in result.stats.verifier["widths"])


def test_prompt_lookup_copies_are_verified_whole_and_left_out_of_the_policy(engines, plain_runs, planted_pair):
    """With prompt lookup on, copy cycles reach the adaptive verifier as LOOKUP drafts: greedy
    output stays that of plain decoding, every copy is verified whole, and the decision log holds
    exactly the drafter's and plain cycles."""
    from speculant.core.types import DraftSource

    # chains only: with trees (tests/test_tree_adaptive.py) a copy can be one path of a tree instead
    eng = engine(planted_pair["target"], planted_pair["draft"], verifier={**VARIED, "tree": "off"}, lookup=True)
    whole, plan = [], eng.verifier.plan

    def record(draft, max_tokens, context_length):
        n = plan(draft, max_tokens, context_length)
        if draft.source is DraftSource.LOOKUP:
            whole.append(n == min(draft.num_tokens, max_tokens))
        return n

    eng.verifier.plan = record
    copies = 0
    for prompt in ([11, 12, 13, 14] * 4, PROMPTS["short"]):
        result = eng.run(prompt_ids=prompt, max_new_tokens=40, block_size=8, ignore_eos=True)
        assert result.token_ids == plain_runs(prompt, 40, ignore_eos=True)
        stats, decisions = result.stats, result.stats.verifier
        assert len(decisions["widths"]) == len(decisions["actions"]) == stats.verify_steps - stats.lookup_steps
        copies += stats.lookup_steps
    assert copies > 0 and len(whole) == copies and all(whole)
