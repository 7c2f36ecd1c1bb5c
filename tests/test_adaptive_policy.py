"""The adaptive verifier's policy on hand-built cost tables and acceptance histories.

``drive`` calls the verifier's hooks in the engine's order (wants_draft, plan, observe) with
timings taken from a hand-built table of seconds per verify width and acceptance outcomes from
a scripted process, so every decision can be checked against the analytic optimum.
"""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

from speculant.core.types import CycleTiming, Draft, DraftSource, Verification
from speculant.verifiers.adaptive import WARMUP, AdaptiveVerifier, host_confidence
from speculant.verifiers.adaptive.acceptance import AcceptanceModel, expected_tokens
from speculant.verifiers.adaptive.cost import CostModel, context_bucket
from speculant.verifiers.adaptive.drift import DriftDetector, RepeatWatch, constant_rate_fit, token_distribution
from speculant.verifiers.adaptive.rates import best_rate, best_width
from speculant.verifiers.adaptive.states import Estimate, Mode

K = 15
FLAT = [1e-3 * (1.0 + 0.01 * w) for w in range(K + 1)]  # seconds for width w + 1
STAIRS = [1e-3 * (1 + w // 4) for w in range(K + 1)]  # widths 1-4: 1 ms, 5-8: 2 ms, 9-12: 3 ms, 13-16: 4 ms


def drive(verifier, cycles, accept, costs, draft_s=0.3e-3, k=K, confidence=None, start=100, noise=0.0, seed=0,
          totals=None, cold=1.0, output=None):
    """Run ``cycles`` cycles; ``accept(cycle, n, confidences)`` -> accepted count. Returns widths;
    ``totals`` (a dict) gets the committed tokens and the seconds they cost added to it; the
    first draft and the first forward of each width take ``cold`` times as long. The committed
    token ids come from the iterator ``output`` (default: never repeating)."""
    rng = np.random.default_rng(seed)
    output = itertools.count(1000) if output is None else output
    widths = []
    seen = set()
    for c in range(cycles):
        ctx = start + c
        conf = confidence(c) if confidence else None
        if verifier.wants_draft(k, ctx):
            n = verifier.plan(Draft(np.zeros(k, dtype=np.int64), k, confidence=conf), k, ctx)
            drafted = k
        else:
            n, drafted = 0, 0
        accepted = min(accept(c, n, conf), n)
        jitter = 1.0 + noise * rng.standard_normal() if noise else 1.0
        first_draft = bool(drafted) and "draft" not in seen
        target_s = costs[n] * jitter * (cold if n not in seen else 1.0)
        seen.update({n, "draft"} if drafted else {n})
        timing = CycleTiming(ctx, n, drafted, target_s, draft_s * (cold if first_draft else 1.0) if drafted else 0.0, 0.0)
        verifier.observe(Verification(accepted, [next(output) for _ in range(accepted + 1)]), n, timing)
        widths.append(n)
        if totals is not None:
            totals["tokens"] = totals.get("tokens", 0) + accepted + 1
            totals["seconds"] = totals.get("seconds", 0.0) + timing.target_s + timing.draft_s
    return widths


def perfect(c, n, conf):
    return n


def never(c, n, conf):
    return 0


def geometric(rate, seed=1):
    rng = np.random.default_rng(seed)

    def accept(c, n, conf):
        a = 0
        while a < n and rng.random() < rate:
            a += 1
        return a

    return accept


# -- the pure decision functions ---------------------------------------------------------------

def brute_force(probs, costs, draft, rest):
    rates = []
    for n in range(1, len(probs) + 1):
        tokens = 1 + sum(np.prod(probs[:j]) for j in range(1, n + 1))
        rates.append(tokens / (draft + costs[n] + rest))
    return max(rates), 1 + int(np.argmax(rates))


@pytest.mark.parametrize("seed", range(40))
def test_best_rate_is_the_argmax_of_tokens_per_second(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 16))
    probs = list(rng.uniform(0.0, 1.0, k))
    steps = np.sort(rng.choice([1.0, 1.0, 1.5, 2.0, 3.0], size=k + 1))  # a random staircase
    costs = list(np.cumsum(steps) / 4 + 1.0)
    draft, rest = float(rng.uniform(0, 2)), float(rng.uniform(0, 0.5))
    rate, n = best_rate(expected_tokens(probs), costs, draft, rest)
    want_rate, want_n = brute_force(probs, costs, draft, rest)
    assert rate == pytest.approx(want_rate)
    assert n == want_n


@pytest.mark.parametrize("seed", range(20))
def test_best_width_agrees_with_the_rate_comparison_at_the_fixed_point(seed):
    rng = np.random.default_rng(100 + seed)
    probs = list(rng.uniform(0.2, 1.0, K))
    costs = list(np.cumsum(rng.choice([0.0, 0.0, 0.5, 1.0], size=K + 1)) + 1.0)
    gains = expected_tokens(probs)
    draft = 0.7
    rate, n = best_rate(gains, costs, draft, 0.0)
    plain = 1.0 / costs[0]
    rho = max(rate, plain)
    if rate >= plain:  # the draft cost cancels: the same n as the rate comparison
        assert best_width(gains, costs, rho) == n
    # in any case: the n maximising E(n) - rho * T(n+1), the draft being already paid for
    values = [gains[m] - rho * costs[m] for m in range(K + 1)]
    assert best_width(gains, costs, rho) == int(np.argmax(values))


def test_staircase_costs_pick_the_edge_of_a_stair():
    probs = [0.8] * K
    gains = expected_tokens(probs)
    rate, n = best_rate(gains, STAIRS, 0.3e-3, 0.0)
    assert n == 3  # width 4: the last width before the 2 ms stair
    # with near-perfect acceptance the longer stairs pay off
    assert best_rate(expected_tokens([0.99] * K), STAIRS, 0.3e-3, 0.0)[1] in (11, 15)


# -- the policy through the verifier's hooks ----------------------------------------------------

def test_perfect_acceptance_uses_the_full_width():
    v = AdaptiveVerifier()
    widths = drive(v, 200, perfect, FLAT)
    warm = len(WARMUP)
    assert widths[:warm] == [K if a == "probe" else 0 for a in WARMUP]  # both ends of the cost curve
    # besides a few plain re-measurements and explorations of unmeasured widths
    assert sum(w == K for w in widths[warm:]) >= 0.92 * len(widths[warm:])
    # plain steps until the plain-step cost has 3 samples in each context bucket (3 buckets here)
    assert 2 <= v.decisions()["fallback_cycles"].get("refresh", 0) <= 8
    assert v.decisions()["acceptance"][:3] == pytest.approx([1.0, 1.0, 1.0], abs=0.1)


# costs as measured for the shipped pair on a 2-core CPU in bf16: a plain step 7.9 ms, a forward
# of 8 rows 14.2 ms, a DFlash2 draft 7.5 ms (break-even at about 3.4 tokens per cycle)
SMALL_CPU = [7.9e-3 + 0.9e-3 * n for n in range(8)]


def test_a_rejected_first_block_and_cold_timings_do_not_end_speculation():
    """A fresh process: its first draft and first wide forward run twice as slow as later ones,
    and the first block is rejected (a request's first tokens are atypical); every later block
    passes whole. The warm-up must gather enough evidence to keep speculating."""
    v = AdaptiveVerifier()
    v.begin(4)
    late = lambda c, n, conf: 0 if c == 0 else n  # noqa: E731
    widths = drive(v, 120, late, SMALL_CPU, draft_s=7.5e-3, k=7, start=4, cold=2.0)
    warm = len(WARMUP)
    assert sum(w == 7 for w in widths[warm:]) >= 0.9 * (120 - warm)
    assert not any(e["mode"] == "fallback" for e in v.decisions()["events"])


def test_a_probe_that_passes_whole_blocks_resumes_speculation():
    """The warm-up's blocks are all rejected, so the policy falls back; from then on every block
    passes whole. The drift window then holds a rejected full block, a narrow probe that passed
    and a whole block (0.89 per draft): the level it sets must say so, and speculation resume."""
    v = AdaptiveVerifier()
    v.begin(4)
    warm = len(WARMUP)
    late = lambda c, n, conf: 0 if c < warm else n  # noqa: E731
    widths = drive(v, 80, late, SMALL_CPU, draft_s=7.5e-3, k=7, start=4)
    assert v.decisions()["events"][0]["mode"] == "fallback"
    resumed = next(i for i in range(warm, len(widths) - 1) if widths[i] == 7 and widths[i + 1] == 7)
    assert resumed <= warm + 12 and all(w == 7 for w in widths[resumed:resumed + 40])


@pytest.mark.parametrize("ratio, resumes", [(0.97, True), (0.9, False)])
def test_a_passing_full_probe_resumes_within_the_fallback_band(monkeypatch, ratio, resumes):
    """Falling back takes plain beating speculation by ``hysteresis``; a full-width probe whose
    drafts passed resumes on the same threshold (a narrow one still escalates). Asking it for
    speculation beating plain outright failed near-ties and backed off for dozens of plain
    cycles where speculation paid (on the shipped pair, 33 cycles; 6 % of a run)."""
    v = AdaptiveVerifier({"hysteresis": 0.05})
    drive(v, len(WARMUP) + 4, never, SMALL_CPU, draft_s=7.5e-3, k=7)
    policy = v.policy
    assert policy.mode is Mode.FALLBACK
    while not policy.wants_draft(7, 200):  # plain cycles until the probe
        policy.observe(0, 0, CycleTiming(200, 0, 0, SMALL_CPU[0]), 0.0)
    plain = 1.0 / SMALL_CPU[0]
    monkeypatch.setattr(policy, "estimate", lambda k, context: Estimate(plain, ratio * plain, 1))
    for stage in ("narrow", "full"):
        n = policy.plan(7, 7, 200, None)
        assert (n < 7) == (stage == "narrow")
        policy.observe(n, 1, CycleTiming(200, n, 7, SMALL_CPU[n], 7.5e-3), 0.0)
        if stage == "narrow":  # one passed draft: not evidence enough inside the band
            assert policy.mode is Mode.PROBE
            assert policy.wants_draft(7, 200)
    assert (policy.mode is Mode.SPECULATE) is resumes


def test_drift_level_is_the_constant_rate_that_explains_cycles_of_any_width():
    cycles = [(1, 7), (2, 1), (8, 7)]  # a rejected block, a narrow probe that passed, a whole block
    rate, loglik = constant_rate_fit(cycles)
    assert rate == pytest.approx(8 / 9)  # 8 drafts accepted, 1 rejected
    grid = [constant_rate_loglik(cycles, a / 100) for a in range(1, 100)]
    assert loglik == pytest.approx(max(grid), abs=1e-2) and loglik >= max(grid) - 1e-12
    detector = DriftDetector()
    changes = [detector.update(t, token_distribution([0.2] * n)) for t, n in cycles]
    assert changes[-1] == "rose" and detector.last_rate == pytest.approx(8 / 9)


def constant_rate_loglik(cycles, a):
    return sum(np.log(token_distribution([a] * n)[t - 1]) for t, n in cycles)


def test_zero_acceptance_falls_back_and_keeps_probing_within_budget():
    v = AdaptiveVerifier({"probe_budget": 0.02, "max_probe_interval": 256})
    widths = drive(v, 3000, never, FLAT)
    d = v.decisions()
    warm = len(WARMUP)
    first_plain = next(i for i in range(warm, len(widths)) if widths[i] == 0)
    assert first_plain <= warm + 4
    actions = d["actions"]
    probes = [i for i, a in enumerate(actions) if i >= warm and a == "probe" and actions[i - 1] != "probe"]  # probe starts
    assert len(probes) >= 8  # never locked into fallback
    assert all(actions[i + 1] == "probe" for i in probes[1:])  # each probe tries two anchors
    gaps = np.diff(probes)
    assert all(b >= a for a, b in zip(gaps, gaps[1:]))  # intervals only grow while probes fail
    assert gaps[-1] <= 257
    # probing cost: extra time over plain decoding stays within the budget (plus warm-up)
    extra = sum(0.3e-3 + FLAT[w] - FLAT[0] for w in widths[first_plain:] if w)
    assert extra / (len(widths[first_plain:]) * FLAT[0]) < 0.025
    assert d["fallback_cycles"]["cost"] >= 0.97 * len(widths) - 10
    assert d["events"][0]["mode"] == "fallback"


def test_repeat_watch_hits_when_a_span_recurs():
    watch = RepeatWatch()
    span = list(range(RepeatWatch.SPAN))
    assert not watch.add(span) and not watch.add([99])  # nothing has come twice yet
    assert not watch.add(span[:-1]) and watch.add(span[-1:])  # the span completes a second time
    watch.reset()
    assert not watch.add(span)


def looping_after(hopeless_cycles, probe_on_repeat):
    """A request whose drafts never pass for ``hopeless_cycles`` cycles (long back-off), after which
    its output loops over five tokens and every draft passes. Returns the cycles it took in the
    loop before two full blocks in a row, and the back-off the loop started under."""
    v = AdaptiveVerifier({"probe_on_repeat": probe_on_repeat})
    v.begin(10)
    drive(v, hopeless_cycles, never, SMALL_CPU, draft_s=7.5e-3, k=7, start=10)
    waiting = v.decisions()["next_probe_in"]
    widths = drive(v, 300, perfect, SMALL_CPU, draft_s=7.5e-3, k=7, start=10 + hopeless_cycles,
                   output=itertools.cycle(range(5)))
    return next(i for i in range(len(widths) - 1) if widths[i] == 7 and widths[i + 1] == 7), waiting


def test_output_that_starts_looping_is_probed_soon():
    found, waiting = looping_after(400, probe_on_repeat=True)
    assert waiting > 60  # the back-off alone would wait this long
    assert found <= 20  # a repeated 8-token span after 13 tokens, then a probe and a full block
    found_without, _ = looping_after(400, probe_on_repeat=False)
    assert found_without >= waiting - 1


def test_repeat_probes_that_fail_back_off():
    """Output that loops while no draft ever passes (a loop the drafter cannot copy): each failed
    hint doubles the gap before the next, so a long request pays for a handful of them, and the
    back-off's own probes go on as they would."""
    v = AdaptiveVerifier({"probe_budget": 0.02, "max_probe_interval": 256})
    widths = drive(v, 3000, never, FLAT, output=itertools.cycle(range(5)))
    warm = len(WARMUP)
    first_plain = next(i for i in range(warm, len(widths)) if widths[i] == 0)
    hints = [e["cycle"] for e in v.decisions()["events"] if "repeats" in e["reason"]]
    assert 3 <= len(hints) <= 8
    gaps = np.diff(hints)
    assert all(b >= 1.5 * a for a, b in zip(gaps, gaps[1:]))
    extra = sum(0.3e-3 + FLAT[w] - FLAT[0] for w in widths[first_plain:] if w)
    assert extra / (len(widths[first_plain:]) * FLAT[0]) < 0.02 + 0.003  # the budget, plus the few hints
    v.begin(10)  # a new request may loop over text the drafter knows: hints come soon again
    drive(v, 40, never, FLAT, start=10, output=itertools.cycle(range(5)))
    assert any("repeats" in e["reason"] and e["cycle"] <= 30 for e in v.decisions()["events"])


def test_acceptance_that_collapses_and_recovers():
    phases = [(80, perfect), (300, never), (400, perfect)]
    v = AdaptiveVerifier({"max_probe_interval": 64})

    def accept(c, n, conf):
        for length, rule in phases:
            if c < length:
                return rule(c, n, conf)
            c -= length
        raise AssertionError

    widths = drive(v, sum(p[0] for p in phases), accept, FLAT)
    good1, bad, good2 = widths[:80], widths[80:380], widths[380:]
    assert sum(w == K for w in good1[len(WARMUP):]) >= 0.9 * (80 - len(WARMUP))
    actions = v.decisions()["actions"][80:380]
    assert set(actions[10:]) == {"plain:cost", "probe"}  # fallback within a few cycles, then probes
    assert 4 <= actions[10:].count("probe") <= 16
    recovered = next(i for i, w in enumerate(good2) if w == K and good2[i + 1] == K)
    assert recovered <= 64 + 2  # at the next probe at the latest
    assert sum(w == K for w in good2[recovered:]) >= 0.95 * len(good2[recovered:])
    modes = [e["mode"] for e in v.decisions()["events"]]
    assert "fallback" in modes and modes[-1] == "speculate"


def test_every_new_request_probes_early_by_default():
    v = AdaptiveVerifier({"max_probe_interval": 512})
    probed = []
    for request in range(8):
        v.begin(10)
        drive(v, 30, never, FLAT, start=10)
        probed.append("probe" in v.decisions()["actions"])
    assert all(probed)


def test_new_requests_probe_early_but_less_often_while_probes_fail():
    v = AdaptiveVerifier({"max_probe_interval": 512, "request_probe_gap": 4})
    probed = []
    for request in range(14):
        v.begin(10)
        drive(v, 30, never, FLAT, start=10)
        probed.append("probe" in v.decisions()["actions"])
    assert probed[:2] == [True, True] and 3 <= sum(probed[2:]) <= 5  # then every 4th request
    for request in range(4):  # an easy request is noticed within a few requests
        v.begin(10)
        widths = drive(v, 30, perfect, FLAT, start=10)
        if widths[-1] == K:
            break
    assert widths[-1] == K and request < 4


@pytest.mark.parametrize("seed", range(3))
def test_a_lucky_first_draft_does_not_resume_speculation(seed):
    """Only the first draft passes, half the time, and a draft costs 0.6 of a plain step:
    speculating at any width commits 1.5 tokens in 1.6 steps, so plain decoding is right. A
    probe whose first draft passes (one cheap draft beating one plain step) must not switch
    speculation back on; resuming on that single cycle's rate lost 2.5 % here, this loses about
    1.4 % over ten seeds (with a 2 % probe budget, so that the failed probes' own cost stays below
    what is checked; full-width probes resuming within ``hysteresis`` of plain add 0.15 % of it)."""
    rng = np.random.default_rng(seed)
    v = AdaptiveVerifier({"probe_budget": 0.02})
    totals: dict = {}
    drive(v, 3000, lambda c, n, conf: int(n > 0 and rng.random() < 0.5), FLAT, draft_s=0.6e-3, totals=totals)
    assert v.decisions()["actions"].count("probe") >= 40  # it kept probing, and about half the probes passed
    assert totals["tokens"] / totals["seconds"] >= 0.98 / FLAT[0]


def test_a_request_probes_twice_on_its_own_schedule():
    """After a run of hopeless requests (long global back-off), a request whose text becomes
    predictable only after its first probe is found by its second probe, not after the back-off."""
    v = AdaptiveVerifier({"max_probe_interval": 512, "request_probe_delay": 5, "probe_interval": 8})
    for _ in range(6):
        v.begin(10)
        drive(v, 60, never, FLAT, start=10, draft_s=0.6e-3)
    assert v.decisions()["next_probe_in"] > 30  # the global back-off has grown
    v.begin(10)
    late = lambda c, n, conf: 0 if c < 8 else n  # noqa: E731  (predictable from cycle 8 on)
    widths = drive(v, 60, late, FLAT, start=10, draft_s=0.6e-3)
    actions = v.decisions()["actions"]
    assert actions[5] == "probe" and actions[6] != "probe"  # one single-draft try at the delay
    assert actions[13] == "probe"  # the second request probe, probe_interval later
    assert all(w == K for w in widths[16:])


def test_a_request_after_a_predictable_one_falls_back_within_a_few_cycles():
    """The evidence a new request carries over says whole blocks pass; when none does, the
    drift test must notice within its window instead of letting that evidence decay (17 cycles)."""
    steep = [1e-3 * (1.0 + 0.15 * w) for w in range(8)]  # verify cost grows as on a small CPU target
    v = AdaptiveVerifier()
    v.begin(10)
    mostly = lambda c, n, conf: 0 if c % 7 == 6 else n  # noqa: E731  (whole blocks, one cycle in seven nothing)
    drive(v, 60, mostly, steep, draft_s=0.7e-3, k=7, start=10)
    v.begin(10)
    widths = drive(v, 40, never, steep, draft_s=0.7e-3, k=7, start=10)
    assert next(i for i, w in enumerate(widths) if w == 0) <= 4
    assert v.decisions()["events"][0]["reason"].startswith("acceptance dropped")


def test_partial_acceptance_on_staircase_costs_settles_on_the_stair_edge():
    v = AdaptiveVerifier()
    widths = drive(v, 600, geometric(0.8), STAIRS)
    tail = widths[200:]
    assert max(set(tail), key=tail.count) == 3
    assert sum(w in (3, 7) for w in tail) >= 0.9 * len(tail)


def test_non_monotone_costs_find_the_cheap_width():
    # BLAS kernels change with the row count: here 15 rows cost less than 14 or 16
    costs = [1e-3] * 13 + [3e-3, 1.05e-3, 3e-3]
    v = AdaptiveVerifier()
    widths = drive(v, 300, perfect, costs, noise=0.1)
    tail = widths[60:]
    assert sum(w == 14 for w in tail) >= 0.85 * len(tail)
    est = v.decisions()["cost"]["target"]  # relative costs: only ratios are meaningful
    assert est[14] / est[12] == pytest.approx(1.05, rel=0.15) and est[13] > est[14] < est[15]


def test_fixed_cost_table_option_is_used_instead_of_timings():
    v = AdaptiveVerifier({"cost_table": [1.0] * 4 + [2.0] * 4 + [3.0] * 8, "draft_cost": 0.3})
    widths = drive(v, 300, geometric(0.8, seed=3), [5.0] * (K + 1))  # measured timings say otherwise
    assert widths[0] != 0  # no warm-up with a fixed table
    tail = widths[100:]
    assert max(set(tail), key=tail.count) == 3
    assert v.decisions()["cost"]["unit"] == "table"


def test_hysteresis_prevents_flapping_near_break_even():
    # speculation at width 2 is within a few percent of plain; timings jitter by 5 %
    costs = [1e-3] * (K + 1)

    def switches(h):
        v = AdaptiveVerifier({"hysteresis": h, "probe_interval": 1, "probe_budget": 1.0, "max_probe_interval": 1})
        drive(v, 1500, geometric(0.27, seed=5), costs, draft_s=0.25e-3, k=1, noise=0.05, seed=2)
        return len(v.decisions()["events"])

    assert switches(0.1) < switches(0.0) / 2


def test_draft_confidence_is_calibrated_and_truncates_the_submission():
    rng = np.random.default_rng(7)
    confidences = [list(rng.choice([0.15, 0.9], size=K, p=[0.25, 0.75])) for _ in range(800)]

    def leading_high(conf):
        return next((j for j, c in enumerate(conf) if c < 0.5), K)

    def accept(c, n, conf):  # high-confidence drafts always pass, low-confidence ones never
        return min(n, leading_high(conf))

    costs = [1e-3 * (1.0 + 0.1 * w) for w in range(K + 1)]  # each extra row costs 10 %
    v = AdaptiveVerifier()
    widths = drive(v, 800, accept, costs, confidence=lambda c: confidences[c])
    tail = range(400, 800)
    hits = sum(widths[c] == leading_high(confidences[c]) for c in tail)
    assert hits >= 0.85 * len(tail)
    shifts = [v.policy.acceptance._shift(v.policy.acceptance._bin(c)) for c in (0.15, 0.9)]
    assert shifts[0] < -3 and shifts[1] > 1
    # the same policy without confidence cannot do this
    blind = AdaptiveVerifier({"use_confidence": False})
    blind_widths = drive(blind, 800, accept, costs, confidence=lambda c: confidences[c])
    assert sum(blind_widths[c] == leading_high(confidences[c]) for c in tail) < hits / 2


def test_confidence_from_backend_arrays():
    torch = pytest.importorskip("torch")
    values = [0.25, 0.5, 0.75]
    assert host_confidence(values) == values
    assert host_confidence(np.asarray(values, dtype=np.float64)) == values
    assert host_confidence(torch.tensor(values, dtype=torch.float64)) == values
    assert host_confidence(torch.tensor(values, dtype=torch.float64)[:, None]) == values
    assert host_confidence(None) is None
    v = AdaptiveVerifier()
    v.wants_draft(3, 10)
    assert v.plan(Draft(np.zeros(3, dtype=np.int64), 3, confidence=torch.tensor(values)), 3, 10) == 3  # warm-up probe


def test_scores_and_log_probabilities_are_binned_monotonically():
    m = AcceptanceModel()
    low, high = m._bin(0.05), m._bin(0.95)
    assert low < high and m._bin(-3.0) == m._bin(np.exp(-3.0))
    m._bin(5.0)  # a score above 1: the drafter's confidences are scores from now on
    assert m.scores and m._bin(0.5) < m._bin(5.0) < m._bin(50.0)


def test_max_context_makes_the_rest_of_the_request_plain():
    v = AdaptiveVerifier({"max_context": 120})
    v.begin(100)
    widths = drive(v, 40, perfect, FLAT, start=100)
    assert all(w == 0 for w in widths[20:]) and any(widths[:20])
    d = v.decisions()
    assert d["plain_from_context"] == 120
    assert d["fallback_cycles"]["max_context"] == 20
    v.begin(500)
    assert v.decisions()["plain_from_context"] == 500


def test_decisions_record_every_cycle():
    v = AdaptiveVerifier()
    v.begin(10)
    widths = drive(v, 50, never, FLAT, start=10)
    d = v.decisions()
    assert d["widths"] == widths and len(d["actions"]) == 50
    assert tuple(d["actions"][:len(WARMUP)]) == WARMUP
    assert sum(d["fallback_cycles"].values()) + d["speculative_cycles"] == 50
    assert {"mode", "events", "acceptance", "cost", "next_probe_in"} <= set(d)


def test_options_are_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        AdaptiveVerifier({"hysteresis": 2.0})
    with pytest.raises(ValidationError):
        AdaptiveVerifier({"no_such_option": 1})
    with pytest.raises(ValidationError):
        AdaptiveVerifier({"draft_cost": 0.2})  # needs cost_table
    with pytest.raises(ValidationError):
        AdaptiveVerifier({"probe_interval": 64, "max_probe_interval": 8})


def test_validator_reports_bad_adaptive_options(tiny_target):
    from speculant.api import validate

    config = {"target": {"path": str(tiny_target)}, "backend": {"kind": "torch", "device": "cpu"},
              "verifier": {"kind": "adaptive", "options": {"max_context": 0}}}
    report = validate(config)
    assert [p.field for p in report.errors] == ["verifier.options"]
    config["verifier"]["options"] = {"max_context": 64}
    assert validate(config).ok


# -- the cost model -------------------------------------------------------------------------

def test_cost_model_learns_a_measured_staircase():
    model = CostModel()
    rng = np.random.default_rng(0)
    for _ in range(60):
        for w in (1, 4, 5, 8, 16):
            model.add_target(w, 300, STAIRS[w - 1] * (1 + 0.05 * rng.standard_normal()))
    est = model.target_s(16, 300)
    for w in (1, 4, 5, 8, 16):
        assert est[w - 1] == pytest.approx(STAIRS[w - 1], rel=0.12)
    assert all(STAIRS[0] * 0.9 <= e <= STAIRS[-1] * 1.1 for e in est)  # unmeasured widths follow the line


def test_cost_model_clips_spikes_and_distrusts_early_spikes():
    model = CostModel()
    for _ in range(20):
        model.add_target(1, 50, 1e-3)
        model.add_target(16, 50, 1.2e-3)
    model.add_target(16, 50, 1.0)  # a descheduling spike
    est = model.target_s(16, 50)
    assert est[-1] / est[0] < 2.0
    model.add_target(8, 50, 5e-3)  # width 8's first sample is a spike, its second is not
    model.add_target(8, 50, 1.1e-3)
    est = model.target_s(16, 50)
    line = est[0] + (est[-1] - est[0]) * 7 / 15
    assert est[7] == pytest.approx(line, rel=0.1)  # too few samples: it follows the line
    for _ in range(10):
        for w, t in ((1, 1e-3), (8, 1.3e-3), (16, 1.2e-3)):  # 8 rows really cost more than 16
            model.add_target(w, 50, t)
    est = model.target_s(16, 50)
    assert est[7] / est[0] == pytest.approx(1.3, rel=0.1)


def test_cost_model_tracks_the_machine_load_without_distorting_ratios():
    model = CostModel()
    for load in [1.0] * 10 + [3.0] * 10 + [1.5] * 10:  # other processes come and go
        for w, t in ((1, 1e-3), (8, 1.2e-3), (16, 1.5e-3)):
            model.add_target(w, 50, t * load)
    est = model.target_s(16, 50)
    assert est[7] / est[0] == pytest.approx(1.2, rel=0.05) and est[15] / est[0] == pytest.approx(1.5, rel=0.05)
    assert model.load == pytest.approx(1.5, rel=0.2)
    model.add_target(4, 50, 1.1e-3 * 1.5)  # a width first measured under load is not penalised
    assert model.target_s(16, 50)[3] / est[0] == pytest.approx(1.1, rel=0.1)


def test_cost_model_borrows_across_context_buckets_with_scaling():
    model = CostModel()
    for _ in range(10):
        model.add_target(1, 100, 1e-3)
        model.add_target(16, 100, 2e-3)
        model.add_target(1, 2000, 3e-3)  # long context: plain steps three times slower
    assert context_bucket(100) != context_bucket(2000)
    est = model.target_s(16, 2000)
    assert est[0] == pytest.approx(3e-3, rel=0.05)
    assert est[-1] == pytest.approx(6e-3, rel=0.25)  # width 16 scaled by the plain-step ratio


def test_no_cycle_reads_more_than_one_expected_tokens_table():
    # E(n) is monotone and bounded by n + 1
    for probs in itertools.product([0.0, 0.5, 1.0], repeat=3):
        e = expected_tokens(probs)
        assert all(b >= a for a, b in zip(e, e[1:])) and all(v <= i + 1 for i, v in enumerate(e))


# -- prompt-lookup copies are verified whole and teach the policy nothing ------------------------

def copy_draft(k):
    return Draft(np.arange(k, dtype=np.int64), k, confidence=[0.01] * k, source=DraftSource.LOOKUP)


def fallen_back():
    """A verifier in fallback (hopeless drafts), where any model draft is planned at width 0."""
    v = AdaptiveVerifier()
    v.begin(10)
    drive(v, 60, never, FLAT, start=10)
    assert v.decisions()["mode"] == "fallback" and v.decisions()["next_probe_in"] > 1
    return v


def test_a_copy_is_planned_whole_without_touching_the_policy():
    v = fallen_back()
    state, record = pickle.dumps(v.policy), v.decisions()
    assert v.plan(copy_draft(5), 7, 70) == 5
    assert v.plan(copy_draft(5), 3, 70) == 3
    assert pickle.dumps(v.policy) == state and v.decisions() == record
    # a model draft in the same state is the policy's to plan: a plain step, and the back-off moves
    assert v.plan(Draft(np.arange(5, dtype=np.int64), 5), 5, 70) == 0
    assert pickle.dumps(v.policy) != state


def copy_cycle(v, ctx, source=DraftSource.LOOKUP):
    """A copy cycle as the engine reports it: what was planned of the copy accepted whole, in a
    cheap forward. With ``source`` MODEL, the same tokens as if the drafter had proposed them."""
    draft = copy_draft(K)
    draft.source = source
    n = v.plan(draft, K, ctx)
    v.observe(Verification(n, list(range(n + 1))), n, CycleTiming(ctx, n, K, 1e-6, 0.0, 0.0, source=source))


def test_copy_cycles_are_not_observed():
    v = fallen_back()
    state, record = pickle.dumps(v.policy), v.decisions()
    copy_cycle(v, 70)
    assert pickle.dumps(v.policy) == state and v.decisions() == record
    copy_cycle(v, 70, source=DraftSource.MODEL)  # the same cycle from the drafter is learned from
    assert pickle.dumps(v.policy) != state and v.decisions()["widths"] == record["widths"] + [0]


def test_copy_cycles_between_model_cycles_change_no_decision():
    """Whole copies accepted at a fraction of a plain step's cost would make speculation look
    free; with a copy cycle after every model cycle the policy must decide exactly as without."""
    accepted = np.random.default_rng(4).geometric(0.7, size=300) - 1  # mostly 0 or 1 of the drafts

    def run(copies):
        v = AdaptiveVerifier()
        v.begin(100)
        for c in range(300):
            ctx = 100 + c
            n = v.plan(Draft(np.zeros(K, dtype=np.int64), K), K, ctx) if v.wants_draft(K, ctx) else 0
            a = min(n, int(accepted[c]))
            v.observe(Verification(a, [c] * (a + 1)), n, CycleTiming(ctx, n, K if n else 0, FLAT[n], 0.3e-3 if n else 0.0))
            if copies:
                copy_cycle(v, ctx + 1, copies)
        return v.decisions()

    alone = run(None)
    assert run(DraftSource.LOOKUP) == alone
    assert run(DraftSource.MODEL) != alone  # learned from, the same copies change the decisions


def test_a_draft_after_a_backlog_may_lower_the_draft_cost_but_never_raise_it():
    """A draft call after a run of plain steps (or a request's first) first reads every target row
    the drafter has not seen: it bounds a steady call from above and must not price one."""
    costs = CostModel()
    for _ in range(3):
        costs.add_draft(1e-3)
    costs.add_draft(8e-3, backlog=True)
    assert costs.draft_s() == pytest.approx(1e-3)
    costs.add_draft(0.5e-3, backlog=True)
    assert costs.draft_s() < 1e-3
    costs.add_draft(8e-3)  # a steady call that slow is news
    assert costs.draft_s() > 1e-3


def test_draft_cost_is_kept_per_draft_length():
    """A block drafter's forward grows with its rows: each length keeps its own cost, and a length
    not measured yet costs a line through those that were (flat while only one was)."""
    costs = CostModel()
    for _ in range(3):
        costs.add_draft(2e-3, length=7)
    assert costs.draft_s(3) == pytest.approx(2e-3) and costs.draft_s() == pytest.approx(2e-3)
    for _ in range(3):
        costs.add_draft(1e-3, length=3)
    assert costs.draft_s(3) == pytest.approx(1e-3) and costs.draft_s(7) == pytest.approx(2e-3)
    assert costs.draft_s(5) == pytest.approx(1.5e-3) and costs.draft_s() == pytest.approx(2e-3)
    assert set(costs.snapshot(8, 100)["draft_by_length"]) == {3, 7}


def drafted_lengths(verifier, cycles, accept, draft_s_per_token, sampled, k=K, start=100):
    """Like ``drive``, with the draft's length from ``draft_length`` and its cost growing with it;
    sampled drafts carry draft probabilities (so no confidence). Returns (drafted, submitted) per
    drafted cycle."""
    out = []
    for c in range(cycles):
        ctx = start + c
        n, drafted = 0, 0
        if verifier.wants_draft(k, ctx):
            drafted = verifier.draft_length(k, ctx)
            draft = Draft(np.zeros(drafted, dtype=np.int64), drafted, confidence=None if sampled else [0.9] * drafted,
                          draft_probs=np.full((drafted, 4), 0.25) if sampled else None)
            n = verifier.plan(draft, k, ctx)
            out.append((drafted, n))
        accepted = min(accept(c, n, None), n)
        timing = CycleTiming(ctx, n, drafted, FLAT[n], draft_s_per_token * (1 + drafted) if drafted else 0.0, 0.0)
        verifier.observe(Verification(accepted, [1000 + c] * (accepted + 1)), n, timing)
    return out


def test_sampled_drafts_are_drafted_only_as_long_as_history_submits():
    """Sampled drafts' widths come from history alone, so drafting past that width only costs: on
    the real pair at temperature 0.8 (CPU) drafting the whole block of 8 ran at 0.91x the best
    fixed chain, and drafting what is submitted at 0.97x. Exploring cycles still draft the whole
    block (they may choose a wider width), and argmax drafts, whose confidences pick each width
    after drafting, always do."""
    sampled = drafted_lengths(AdaptiveVerifier({"explore_every": 8}), 300, geometric(0.7), 0.03e-3, sampled=True)
    steady = sampled[len(WARMUP) + 20:]
    short = [(d, n) for d, n in steady if d < K]
    assert len(short) > 0.75 * len(steady), steady
    assert all(n <= d for d, n in steady), steady
    assert sum(n == d for d, n in short) >= 0.95 * len(short), short  # drafted as many as it submits
    assert any(d == K for d, n in steady)  # exploring cycles draft the whole block
    argmax = drafted_lengths(AdaptiveVerifier({"explore_every": 8}), 300, geometric(0.7), 0.03e-3, sampled=False)
    assert all(d == K for d, n in argmax)
