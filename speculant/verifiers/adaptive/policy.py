"""The adaptive verifier's policy: how many drafted tokens to submit each cycle.

``docs/adaptive.md`` describes the policy and draws its modes (:class:`Mode`). In short: submitting
n drafts commits ``E(n)`` tokens on average in ``D + T(n+1) + R`` seconds, a plain step one token
in ``T(1) + R``; the policy falls back to plain steps when the best speculative rate loses to the
plain rate by more than ``hysteresis``, probes now and then to find out whether speculation pays
again, and while speculating submits the n maximising ``E_c(n) - rho * T(n+1)`` (E_c with this
cycle's draft confidences, rho the long-run rate).

Every input is draft-side (this cycle's confidences) or from finished cycles (acceptance,
timings): nothing here can see the target output of the cycle being decided.
"""

from __future__ import annotations

import math
from typing import Sequence

from speculant.core.types import CycleTiming
from speculant.verifiers.adaptive.acceptance import AcceptanceModel, expected_tokens
from speculant.verifiers.adaptive.cost import CostModel, RunningMean
from speculant.verifiers.adaptive.drift import DriftDetector, token_distribution
from speculant.verifiers.adaptive.options import AdaptiveOptions
from speculant.verifiers.adaptive.probing import Prober
from speculant.verifiers.adaptive.rates import best_rate, best_width
from speculant.verifiers.adaptive.states import WARMUP, Action, CyclePlan, Estimate, Mode, ProbeStage, Request, Schedule

TRUSTED = RunningMean.TRUSTED
CHECK_EVERY = 4  # cycles between speculation-vs-plain comparisons unless the margin is thin
PROMPT_UNREAD = 1 << 20  # plain_run at a request's start: the drafter has not read the prompt
REFRESH_SOON = 8  # speculative cycles between plain steps while the plain-step cost is uncertain


class AdaptivePolicy:
    """The decisions of the adaptive verifier; no arrays, no target."""

    def __init__(self, options: AdaptiveOptions) -> None:
        o = self.o = options
        self.costs = CostModel(o.cost_alpha, o.cost_table, 0.0 if o.cost_table and o.draft_cost is None else o.draft_cost)
        self.acceptance = AcceptanceModel(o.acceptance_decay, o.prior_acceptance, o.prior_weight)
        self.drift = DriftDetector()
        self.mode = Mode.WARMUP if o.warmup and o.cost_table is None else Mode.SPECULATE
        self.warmup = list(WARMUP)  # the warm-up's remaining cycles
        self.probes = Prober(o)
        self.request = Request()
        self.schedule = Schedule()
        self.this_cycle = CyclePlan()
        # whether speculative widths use draft confidences (then every cycle drafts the whole
        # block, to read them); learnt at each speculative plan, assumed until the first
        self.confident = True

    def begin(self) -> None:
        r = self.request
        r.events, r.cycle, r.k_block = [], 0, 1
        self.this_cycle.action = None
        self.schedule.checks_due = 0
        self.schedule.plain_run = PROMPT_UNREAD  # the drafter's first call reads the whole prompt
        self.acceptance.forget(self.o.request_carryover)
        self.drift.reset()
        self.probes.begin_request(self.mode is Mode.FALLBACK)

    # -- before drafting ---------------------------------------------------------------------
    def wants_draft(self, max_tokens: int, context_length: int) -> bool:
        r = self.request
        r.k, r.context_length = max(1, max_tokens), context_length
        r.k_block = max(r.k_block, r.k)
        if self.o.max_context is not None and context_length >= self.o.max_context:
            action = Action.PLAIN_MAX_CONTEXT
        elif self.mode is Mode.WARMUP:
            action = self.warmup[0]
        elif self.mode is Mode.PROBE:
            action = Action.PROBE
        elif self.mode is Mode.FALLBACK:
            action = self._fallback_action()
        else:
            action = self._speculating_action(context_length)
        self.this_cycle.action = action
        return not action.plain

    def draft_length(self, max_tokens: int) -> int:
        """How many tokens this cycle drafts, once :meth:`wants_draft` said yes: while widths come
        from history alone (sampled drafts, or ``use_confidence`` off), the width history picks,
        since a draft's cost grows with its rows (on a CPU, block 8 against block 4 cost the
        real pair a quarter of its speed at temperature 0.8); else the whole block."""
        c, s = self.this_cycle, self.schedule
        if c.action is not Action.SPECULATE or self.confident or s.last is None:
            return max_tokens
        if self.o.explore_every and (s.speculated + 1) % self.o.explore_every == 0:
            return max_tokens  # an exploring cycle may pick a wider width than history does
        return max(1, min(max_tokens, s.last.spec_width))

    def _fallback_action(self) -> Action:
        if not self.probes.due():
            return Action.PLAIN_COST
        self.mode = Mode.PROBE
        return Action.PROBE

    def _speculating_action(self, context_length: int) -> Action:
        s, r = self.schedule, self.request
        s.checks_due -= 1
        if s.checks_due <= 0 or s.last is None:  # is speculation worth it at all?
            s.last = self.estimate(r.k_block, context_length)
            margin = s.last.spec_rate / max(s.last.plain_rate, 1e-12) - 1.0 + self.o.hysteresis
            s.checks_due = 1 if margin < 0.1 else CHECK_EVERY  # every cycle when it is close
        est = s.last
        if not est.pays(self.o.hysteresis):
            self.mode = Mode.FALLBACK
            self.probes.start_fallback()
            self._event(Mode.FALLBACK, f"plain {est.plain_rate:.1f} tok/s beats speculative {est.spec_rate:.1f} tok/s", est)
            return Action.PLAIN_COST
        if r.k < r.k_block:  # end of the request: fewer drafts allowed this cycle
            est = self.estimate(r.k, context_length)
            if not est.pays():
                return Action.PLAIN_SHORT
        s.rate = max(est.plain_rate, est.spec_rate)
        if self.costs.table is None and s.since_plain >= REFRESH_SOON and self.costs.measured(1, context_length) < TRUSTED:
            return Action.PLAIN_REFRESH  # the plain-step cost here rests on too few samples
        if s.since_plain >= self.o.refresh_interval and est.plain_rate >= 0.75 * est.spec_rate:
            return Action.PLAIN_REFRESH
        return Action.SPECULATE

    # -- after drafting ----------------------------------------------------------------------
    def plan(self, num_drafted: int, max_tokens: int, context_length: int, confidence: Sequence[float | None] | None) -> int:
        k = max(0, min(num_drafted, max_tokens))
        c = self.this_cycle
        if c.action is None:  # the engine did not ask wants_draft (no such hook): decide now
            self.wants_draft(max_tokens, context_length)
        if c.action is Action.PROBE or k == 0:
            narrow = self.mode is Mode.PROBE and self.probes.stage is ProbeStage.NARROW
            n = self._narrow_width(k, context_length) if narrow else k
            c.confidence = list(confidence[:n]) if confidence else None
            c.predicted = token_distribution(self.acceptance.position_rates(n))
            return n
        if c.action is not Action.SPECULATE:  # a plain decision stands even if a draft was made
            return 0
        c.confidence = list(confidence[:k]) if confidence and self.o.use_confidence else None
        self.confident = c.confidence is not None
        probs = self.acceptance.rates(k, c.confidence)
        gains = expected_tokens(probs)
        s = self.schedule
        s.speculated += 1
        explore = self.o.explore_every and s.speculated % self.o.explore_every == 0
        best = best_width(gains, self.costs.target_s(k + 1, context_length, optimistic=bool(explore)), s.rate)
        c.predicted = token_distribution(probs[:best])
        if best == 0:
            c.action = Action.PLAIN_CONFIDENCE
        return best

    def plan_given(self, k: int) -> int:
        """A width chosen outside this policy (a batch's plan): what it predicts, for the drift check."""
        c = self.this_cycle
        c.confidence, c.predicted = None, token_distribution(self.acceptance.position_rates(k))
        return k

    def _narrow_width(self, k: int, context_length: int) -> int:
        """The widest first probe that costs no more than one draft (within 10 %)."""
        costs = self.costs.target_s(k + 1, context_length)
        limit = 1.1 * costs[1] if k >= 1 else 0.0
        return max([n for n in range(1, k + 1) if costs[n] <= limit], default=min(1, k))

    # -- after the cycle ---------------------------------------------------------------------
    def observe(self, submitted: int, accepted: int, timing: CycleTiming | None, verify_s: float,
                token_ids: Sequence[int] = ()) -> Action:
        """Learn from the finished cycle (``token_ids``: what it committed); returns what this
        cycle was (for the decision log)."""
        c = self.this_cycle
        action, c.action = c.action or Action.PLAIN_SHORT, None
        self.request.cycle += 1
        repeating = self.probes.cycle_done(action is Action.PROBE, token_ids)
        if timing is not None:
            self._learn_costs(submitted, timing, verify_s)
        if submitted:
            self._learn_acceptance(submitted, accepted)
        c.confidence = None
        self.acceptance.tick()
        self.schedule.since_plain = 0 if submitted == 0 else self.schedule.since_plain + 1
        self.schedule.plain_run = self.schedule.plain_run + 1 if submitted == 0 else 0
        if action in (Action.PLAIN_SHORT, Action.PLAIN_MAX_CONTEXT):
            return action
        if self.mode is Mode.WARMUP:
            self.warmup.pop(0)
            if not self.warmup:
                self.mode, self.schedule.checks_due = Mode.SPECULATE, 0
        elif self.mode is Mode.PROBE:
            self._after_probe(submitted, accepted)
        elif self.mode is Mode.FALLBACK and repeating and self.probes.bring_forward():
            self._event(Mode.FALLBACK, "the output repeats an earlier span: probe next cycle", None)
        return action

    def speculating(self, max_tokens: int, context_length: int) -> bool:
        """Whether this cycle submits drafts at a planned width (not a warm-up, probe or plain step)."""
        if self.this_cycle.action is None:  # the engine did not ask wants_draft: decide now
            self.wants_draft(max_tokens, context_length)
        return self.this_cycle.action is Action.SPECULATE

    def tree_done(self, token_ids: Sequence[int]) -> Action:
        """A cycle verified as a draft tree: it counts as one of the request's cycles and teaches the
        chain's acceptance and cost models nothing (a tree's depth and forward are not a chain's)."""
        self.this_cycle.action = self.this_cycle.confidence = None
        self.request.cycle += 1
        self.probes.cycle_done(False, token_ids)
        self.schedule.since_plain += 1
        self.schedule.plain_run = 0
        return Action.TREE

    def _learn_costs(self, submitted: int, timing: CycleTiming, verify_s: float) -> None:
        self.costs.add_target(submitted + 1, timing.context_length, timing.target_s)
        if timing.drafted:
            self.costs.add_draft(timing.draft_s, backlog=self.schedule.plain_run > 1, length=timing.drafted)
        self.costs.add_rest(timing.commit_s + verify_s)
        self.request.context_length = timing.context_length

    def _learn_acceptance(self, submitted: int, accepted: int) -> None:
        c, d = self.this_cycle, self.drift
        self.acceptance.observe(submitted, accepted, c.confidence)
        change = d.update(accepted + 1, c.predicted)
        if change:
            self.acceptance.reset_to(d.last_rate, max(submitted, self.request.k_block))
            self.schedule.checks_due = 0
            self._event(self.mode, f"acceptance {change}: {d.last_realized:.2f} tokens per cycle where "
                        f"{d.last_predicted:.2f} were expected; history replaced by the recent "
                        f"level ({d.last_rate:.2f} per draft)", None)

    def _after_probe(self, submitted: int, accepted: int) -> None:
        """Resume speculating when the probe's first draft passed and the acceptance model (now
        holding the probe's evidence) beats plain decoding, or after a full-width probe, comes
        within ``hysteresis`` of it (the band the fallback allows): the probe cycle's own tokens
        per second would be biased, since a cycle whose first draft passed beats a plain step
        even where speculation does not pay. A narrow probe that passed without showing that
        escalates to one full-width cycle; anything else is a failed probe."""
        r, p = self.request, self.probes
        est = self.estimate(r.k_block, r.context_length)
        narrow = p.stage is ProbeStage.NARROW and submitted < r.k
        if accepted == 0:
            if p.retry(narrow):  # the anchor may just have been a bad one
                return
            what = f"first draft rejected {p.tries} time(s)"
        elif est.pays(0.0 if narrow else self.o.hysteresis):  # a full probe: the band the fallback allows
            self.mode, self.schedule.checks_due = Mode.SPECULATE, 0
            p.resumed()
            self._event(Mode.SPECULATE, f"probe: {accepted} draft(s) accepted; speculative {est.spec_rate:.1f} "
                        f"tok/s {'>=' if narrow else 'within hysteresis of'} plain {est.plain_rate:.1f} tok/s", est)
            return
        elif narrow:
            p.stage = ProbeStage.FULL
            return
        else:
            what = f"speculative {est.spec_rate:.1f} tok/s < plain {est.plain_rate:.1f} tok/s"
        p.failed(self.min_interval)
        self.mode = Mode.FALLBACK
        self._event(Mode.FALLBACK, f"probe: {what}; next probe in {p.countdown} cycles", est)

    # -- estimates ---------------------------------------------------------------------------
    def estimate(self, k: int, context_length: int) -> Estimate:
        """Plain and best speculative tokens per second from history alone (no confidence)."""
        costs = self.costs.target_s(k + 1, context_length)
        rest = self.costs.rest_s()
        gains = expected_tokens(self.acceptance.position_rates(k))
        drafts = self.costs.draft_s(k) if self.confident else [self.costs.draft_s(n) for n in range(k + 1)]
        rate, n = best_rate(gains, costs, drafts, rest)
        return Estimate(1.0 / max(costs[0] + rest, 1e-12), rate, n)

    def min_interval(self) -> int:
        """Plain cycles between probes so that failing (narrow) probes cost ``probe_budget`` of
        plain-decoding time."""
        costs = self.costs.target_s(2, self.request.context_length)
        plain = costs[0] + self.costs.rest_s()
        extra = self.o.probe_cycles * max(0.0, self.costs.draft_s(self.request.k_block) + costs[1] - costs[0])
        budget = self.o.probe_budget * plain  # may underflow to 0 for a tiny plain step
        ratio = 0.0 if plain <= 0 else extra / budget if budget > 0 else math.inf
        # compared before rounding: a huge draft cost against a tiny plain step makes the ratio inf
        cycles = math.ceil(ratio) if ratio < self.o.max_probe_interval else self.o.max_probe_interval
        return min(max(cycles, self.o.probe_interval), self.o.max_probe_interval)

    def _event(self, mode: Mode, reason: str, est: Estimate | None) -> None:
        r = self.request
        event = {"cycle": r.cycle, "mode": mode.value, "reason": reason, "context_length": r.context_length}
        if est is not None:
            event.update(plain_tok_s=round(est.plain_rate, 2), speculative_tok_s=round(est.spec_rate, 2), best_width=est.spec_width)
        r.events.append(event)
