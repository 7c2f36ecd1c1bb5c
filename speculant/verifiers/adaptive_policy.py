"""The adaptive verifier's policy: how many drafted tokens to submit each cycle.

With a_j the conditional acceptance of block position j, submitting n drafts commits
``E(n) = 1 + sum_{j<=n} prod_{i<=j} a_i`` tokens on average, in ``D + T(n+1) + R`` seconds
(draft, target forward of width n + 1, drafter commit + verification); a plain step commits
one token in ``T(1) + R``. The policy keeps the long-run rate rho = max(plain rate, best
speculative rate) from history, and each cycle

- before drafting (``wants_draft``): falls back to plain steps, skipping the draft cost, when
  the best speculative rate is below the plain rate by more than ``hysteresis``;
- after drafting (``plan``): submits the n maximising ``E_c(n) - rho * T(n+1)``, where E_c uses
  this cycle's draft confidences. This is the renewal-reward (Dinkelbach) form of maximising
  tokens per second: the draft time already spent cancels, and without confidence it picks
  the same n as the rate comparison.

Fallback is decided for a full block (a short last cycle of a request only skips its draft).
It is never final: after an interval of plain cycles a probe submits one draft (or as many as
cost no more than one), up to ``probe_cycles`` times until the first draft passes. Speculation
resumes only when the acceptance model, now holding the probe's evidence, says it beats plain
decoding; otherwise a probe that passed escalates to one full-width cycle. (The probe cycle's
own tokens per second would be biased: a cycle whose first draft passed beats a plain step even
where speculation does not pay.) A failed probe doubles the interval, from ``probe_interval`` up
to ``max_probe_interval`` and never below what keeps failing probes within ``probe_budget`` of
plain-decoding time. A new request in fallback (``probe_each_request``) has its own schedule,
since one request's content says little about the next: ``request_probes`` single-draft probes,
the first ``request_probe_delay`` cycles in (a request's first tokens are atypical), then
``probe_interval`` apart; only then does the back-off apply. Output that starts repeating an
earlier span of itself (``probe_on_repeat``; small models decoding greedily fall into loops, the
easiest text to draft) brings the next probe forward to the next cycle, ``probe_interval`` cycles
after the last probe at the earliest; each failed one doubles that gap for the rest of the request
and leaves the back-off's schedule as it was. With ``request_probe_gap`` = 4,
requests probe every 2nd and then every 4th time while those probes keep failing. While
speculating it re-measures a plain step every ``refresh_interval`` cycles when plain decoding
is close to competitive, and every 8 cycles while the plain-step cost at this context length
rests on fewer than three samples. The first cycles of a policy's life are a warm-up
(``WARMUP``): four full-width cycles and two plain steps, so both ends of the cost curve are
measured here and no fallback rests on one cycle's acceptance or on one cold timing (a process's
first draft and first wide forward are the slowest it will see; costs start at the median of
their first three samples).

Every input is draft-side (this cycle's confidences) or from finished cycles (acceptance,
timings): nothing here can see the target output of the cycle being decided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from speculant.verifiers.adaptive_acceptance import AcceptanceModel, expected_tokens
from speculant.verifiers.adaptive_cost import CostModel, RunningMean
from speculant.verifiers.adaptive_drift import DriftDetector, RepeatWatch, token_distribution

TRUSTED = RunningMean.TRUSTED
CHECK_EVERY = 4  # cycles between speculation-vs-plain comparisons unless the margin is thin
REFRESH_SOON = 8  # speculative cycles between plain steps while the plain-step cost is uncertain
WARMUP = ("probe", "plain:warmup", "probe", "probe", "plain:warmup", "probe")  # a policy's first cycles


class AdaptiveOptions(BaseModel):
    """``verifier.options`` of the ``adaptive`` verifier."""

    model_config = ConfigDict(extra="forbid")

    max_context: int | None = Field(None, ge=1, description="from this context length on, decode plainly (per request)")
    hysteresis: float = Field(0.05, ge=0.0, lt=1.0, description="fall back only when plain is this much faster")
    acceptance_decay: float = Field(0.95, gt=0.0, lt=1.0, description="per-cycle forgetting of acceptance counts")
    prior_acceptance: float = Field(0.5, gt=0.0, lt=1.0)
    prior_weight: float = Field(1.0, gt=0.0)
    use_confidence: bool = True
    probe_budget: float = Field(0.05, gt=0.0, le=1.0, description="share of plain-decoding time re-probes may cost")
    probe_interval: int = Field(8, ge=1, description="fewest plain cycles between re-probes")
    max_probe_interval: int = Field(512, ge=1, description="most plain cycles between re-probes")
    probe_cycles: int = Field(2, ge=1, description="narrow probe cycles before a probe counts as failed")
    probe_each_request: bool = Field(True, description="probe at the start of every request while in fallback")
    request_probe_delay: int = Field(7, ge=1, description="cycles into a request before its first probe (its first tokens are atypical)")
    request_probes: int = Field(2, ge=1, description="single-draft probes a request makes, probe_interval apart, before the global back-off applies")
    request_probe_gap: int = Field(1, ge=1, description="while request-start probes fail, at most this many requests between them")
    refresh_interval: int = Field(64, ge=1, description="speculative cycles between plain-step re-measurements")
    probe_on_repeat: bool = Field(True, description="probe soon when the output starts repeating itself (failed hints back off per request)")
    request_carryover: float = Field(0.5, ge=0.0, le=1.0, description="share of acceptance evidence a new request keeps")
    warmup: bool = True
    explore_every: int = Field(16, ge=0, description="every n-th speculative cycle decides on optimistic costs (0 = never)")
    cost_alpha: float = Field(0.1, gt=0.0, le=1.0, description="weight of a new timing sample")
    cost_table: list[float] | None = Field(None, min_length=1, description="fixed target cost per width 1, 2, ... (any unit)")
    draft_cost: float | None = Field(None, ge=0.0, description="fixed draft cost, same unit as cost_table")

    @model_validator(mode="after")
    def _consistent(self) -> "AdaptiveOptions":
        if self.max_probe_interval < self.probe_interval:
            raise ValueError("max_probe_interval must be at least probe_interval")
        if self.cost_table is not None and any(not c > 0 for c in self.cost_table):
            raise ValueError("cost_table entries must be positive")
        if self.draft_cost is not None and self.cost_table is None:
            raise ValueError("draft_cost needs cost_table (both are in the table's unit)")
        return self


@dataclass(frozen=True)
class Estimate:
    plain_rate: float  # tokens per second of plain steps
    spec_rate: float  # best tokens per second when speculating, from history alone
    spec_width: int  # the n giving spec_rate


class AdaptivePolicy:
    """The decisions of the adaptive verifier (see the module docstring); no arrays, no target."""

    def __init__(self, options: AdaptiveOptions) -> None:
        o = self.o = options
        self.costs = CostModel(o.cost_alpha, o.cost_table, 0.0 if o.cost_table and o.draft_cost is None else o.draft_cost)
        self.acceptance = AcceptanceModel(o.acceptance_decay, o.prior_acceptance, o.prior_weight)
        self.mode = "warmup" if o.warmup and o.cost_table is None else "speculate"
        self.warmup_steps = list(WARMUP)
        self.interval = o.probe_interval
        self.countdown = 0
        self.probe_stage = "narrow"  # a probe submits one draft first, the full width if it passed
        self.probe_tries = 0
        self.request_gap = 1  # requests between request-start probes while they keep failing
        self.requests_waited = 0
        self.request_probe = False  # the current probe was scheduled by a request start
        self.request_probes_left = 0  # request probes still to come in this request
        self.repeats = RepeatWatch()
        self.repeat_probe = False  # the current probe was brought forward by repeating output
        self.resume_countdown = 0  # the back-off's remaining cycles, kept while a repeat probe runs
        self.since_probe = 0  # cycles since the last probe cycle
        self.repeat_gap = o.probe_interval  # fewest cycles after a probe before a repeat brings the next one forward
        self.since_plain = 0
        self.speculated = 0  # speculative decisions made (schedules exploration)
        self.rate = 0.0
        self.action: str | None = None
        self.confidence: list[float | None] | None = None
        self.predicted = [1.0]  # distribution of tokens this cycle's plan expected
        self.drift = DriftDetector()
        self.k = 1  # drafts allowed this cycle
        self.k_block = 1  # drafts a full block allows (the largest k seen in this request)
        self.context_length = 0
        self.cycle = 0  # cycles of the current request
        self.events: list[dict] = []
        self.last: Estimate | None = None  # the latest speculation-vs-plain comparison
        self.checks_due = 0  # cycles until it is redone (estimates move slowly)

    # -- per cycle ---------------------------------------------------------------------------
    def wants_draft(self, max_tokens: int, context_length: int) -> bool:
        self.k, self.context_length = max(1, max_tokens), context_length
        self.k_block = max(self.k_block, self.k)
        if self.o.max_context is not None and context_length >= self.o.max_context:
            return self._plain("plain:max_context")
        if self.mode == "warmup":
            self.action = self.warmup_steps[0]
            return self.action == "probe"
        if self.mode == "probe":
            self.action = "probe"
            return True
        if self.mode == "fallback":
            self.countdown -= 1
            if self.countdown > 0:
                return self._plain("plain:cost")
            self.mode, self.probe_stage, self.probe_tries, self.action = "probe", "narrow", 0, "probe"
            return True
        self.checks_due -= 1
        if self.checks_due <= 0 or self.last is None:  # is speculation worth it at all?
            self.last = self.estimate(self.k_block, context_length)
            margin = self.last.spec_rate / max(self.last.plain_rate, 1e-12) - 1.0 + self.o.hysteresis
            self.checks_due = 1 if margin < 0.1 else CHECK_EVERY  # every cycle when it is close
        est = self.last
        if est.spec_rate < est.plain_rate * (1.0 - self.o.hysteresis):
            self.mode, self.countdown = "fallback", self.o.probe_interval  # first re-check soon
            self.interval = self.o.probe_interval
            self._event("fallback", f"plain {est.plain_rate:.1f} tok/s beats speculative {est.spec_rate:.1f} tok/s", est)
            return self._plain("plain:cost")
        if self.k < self.k_block:  # end of the request: fewer drafts allowed this cycle
            est = self.estimate(self.k, context_length)
            if est.spec_rate < est.plain_rate:
                return self._plain("plain:short")
        self.rate = max(est.plain_rate, est.spec_rate)
        if self.costs.table is None and self.since_plain >= REFRESH_SOON and self.costs.measured(1, context_length) < TRUSTED:
            return self._plain("plain:refresh")  # the plain-step cost here rests on too few samples
        if self.since_plain >= self.o.refresh_interval and est.plain_rate >= 0.75 * est.spec_rate:
            return self._plain("plain:refresh")
        self.action = "speculate"
        return True

    def plan(self, num_drafted: int, max_tokens: int, context_length: int, confidence: Sequence[float | None] | None) -> int:
        k = max(0, min(num_drafted, max_tokens))
        if self.action is None:  # the engine did not ask wants_draft (no such hook): decide now
            self.wants_draft(max_tokens, context_length)
        if self.action == "probe" or k == 0:
            n = self._narrow_width(k, context_length) if self.mode == "probe" and self.probe_stage == "narrow" else k
            self.confidence = list(confidence[:n]) if confidence else None
            self.predicted = token_distribution(self.acceptance.position_rates(n))
            return n
        if self.action != "speculate":  # a plain decision stands even if a draft was made
            return 0
        self.confidence = list(confidence[:k]) if confidence and self.o.use_confidence else None
        probs = self.acceptance.rates(k, self.confidence)
        gains = expected_tokens(probs)
        self.speculated += 1
        explore = self.o.explore_every and self.speculated % self.o.explore_every == 0
        best = best_width(gains, self.costs.target_s(k + 1, context_length, optimistic=bool(explore)), self.rate)
        self.predicted = token_distribution(probs[:best])
        if best == 0:
            self.action = "plain:confidence"
        return best

    def observe(self, submitted: int, accepted: int, timing, verify_s: float, token_ids: Sequence[int] = ()) -> str:
        """Learn from the finished cycle (``token_ids``: what it committed); returns what this
        cycle was (for the decision log)."""
        action = self.action or "plain:short"
        self.action = None
        self.cycle += 1
        self.since_probe = 0 if action == "probe" else self.since_probe + 1
        repeating = self.o.probe_on_repeat and self.repeats.add(token_ids)  # no bookkeeping when off
        if timing is not None:
            self.costs.add_target(submitted + 1, timing.context_length, timing.target_s)
            if timing.drafted:
                self.costs.add_draft(timing.draft_s)
            self.costs.add_rest(timing.commit_s + verify_s)
            self.context_length = timing.context_length
        if submitted:
            self.acceptance.observe(submitted, accepted, self.confidence)
            change = self.drift.update(accepted + 1, self.predicted)
            if change:
                self.acceptance.reset_to(self.drift.last_rate, max(submitted, self.k_block))
                self.checks_due = 0
                self._event(self.mode, f"acceptance {change}: {self.drift.last_realized:.2f} tokens per cycle where "
                            f"{self.drift.last_predicted:.2f} were expected; history replaced by the recent "
                            f"level ({self.drift.last_rate:.2f} per draft)", None)
        self.confidence = None
        self.acceptance.tick()
        self.since_plain = 0 if submitted == 0 else self.since_plain + 1
        if action in ("plain:short", "plain:max_context"):
            return action
        if self.mode == "warmup":
            self.warmup_steps.pop(0)
            if not self.warmup_steps:
                self.mode, self.checks_due = "speculate", 0
        elif self.mode == "probe":
            self._after_probe(submitted, accepted)
        elif self.mode == "fallback" and repeating:
            self._probe_on_repeat()
        return action

    def _probe_on_repeat(self) -> None:
        """Probe next cycle when the output has started repeating itself, ``repeat_gap`` cycles
        after the last probe at the earliest. A failed one doubles that gap for the rest of the
        request (a loop the drafter cannot copy costs a handful of probes per request) and leaves
        the back-off's schedule as it was."""
        if self.countdown <= 1 or self.since_probe < self.repeat_gap:
            return
        self.repeat_probe, self.resume_countdown, self.countdown = True, self.countdown - 1, 1
        self._event("fallback", "the output repeats an earlier span: probe next cycle", None)

    def _narrow_width(self, k: int, context_length: int) -> int:
        """The widest first probe that costs no more than one draft (within 10 %)."""
        costs = self.costs.target_s(k + 1, context_length)
        limit = 1.1 * costs[1] if k >= 1 else 0.0
        return max([n for n in range(1, k + 1) if costs[n] <= limit], default=min(1, k))

    def _after_probe(self, submitted: int, accepted: int) -> None:
        """Resume speculating when a probe's first draft passed and the acceptance model (now
        holding the probe's evidence) beats plain decoding. A narrow probe that passed but does
        not show that escalates to one full-width cycle; a rejected first draft is retried up to
        ``probe_cycles`` times (once for a request probe: a request has ``request_probes`` of them).
        Any other outcome waits for the request's next probe, or twice as long as last time (at
        least the budget interval)."""
        est = self.estimate(self.k_block, self.context_length)
        narrow = self.probe_stage == "narrow" and submitted < self.k
        if accepted == 0:
            self.probe_tries += 1
            tries = 1 if self.request_probe or self.repeat_probe else self.o.probe_cycles  # a request spreads its tries over its own probes
            if narrow and self.probe_tries < tries:  # the anchor may just have been a bad one
                return
            what = f"first draft rejected {self.probe_tries} time(s)"
        else:
            # the probe cycle's own tokens per second would be biased (a cycle whose first draft
            # passed beats a plain step even when speculation does not pay): the acceptance
            # model, now holding the probe's evidence, decides
            if est.spec_rate >= est.plain_rate:
                self.mode, self.request_gap, self.request_probe, self.checks_due = "speculate", 1, False, 0
                self.repeat_probe = False
                self._event("speculate", f"probe: {accepted} draft(s) accepted; speculative {est.spec_rate:.1f} "
                            f"tok/s >= plain {est.plain_rate:.1f} tok/s", est)
                return
            if narrow:
                self.probe_stage = "full"
                return
            what = f"speculative {est.spec_rate:.1f} tok/s < plain {est.plain_rate:.1f} tok/s"
        if self.repeat_probe:  # a hint that did not pay: the back-off carries on where it was
            self.repeat_probe = False
            self.repeat_gap = min(2 * self.repeat_gap, self.o.max_probe_interval)
            self.mode, self.countdown = "fallback", self.resume_countdown
        elif self.request_probe and self.request_probes_left > 0:  # this request's own schedule, not the back-off
            self.request_probes_left -= 1
            self.mode, self.countdown = "fallback", self.o.probe_interval
        else:
            self.interval = min(max(2 * self.interval, self.min_interval()), self.o.max_probe_interval)
            self.mode, self.countdown = "fallback", self.interval
            if self.request_probe:
                self.request_gap, self.request_probe = min(2 * self.request_gap, self.o.request_probe_gap), False
        self._event("fallback", f"probe: {what}; next probe in {self.countdown} cycles", est)

    # -- estimates ---------------------------------------------------------------------------
    def estimate(self, k: int, context_length: int) -> Estimate:
        """Plain and best speculative tokens per second from history alone (no confidence)."""
        costs = self.costs.target_s(k + 1, context_length)
        rest = self.costs.rest_s()
        gains = expected_tokens(self.acceptance.position_rates(k))
        rate, n = best_rate(gains, costs, self.costs.draft_s(), rest)
        return Estimate(1.0 / max(costs[0] + rest, 1e-12), rate, n)

    def min_interval(self) -> int:
        """Plain cycles between probes so that failing (narrow) probes cost ``probe_budget`` of
        plain-decoding time."""
        costs = self.costs.target_s(2, self.context_length)
        plain = costs[0] + self.costs.rest_s()
        extra = self.o.probe_cycles * max(0.0, self.costs.draft_s() + costs[1] - costs[0])
        cycles = math.ceil(extra / (self.o.probe_budget * plain)) if plain > 0 else self.o.probe_interval
        return min(max(cycles, self.o.probe_interval), self.o.max_probe_interval)

    def begin(self) -> None:
        self.events = []
        self.action = None
        self.cycle = 0
        self.k_block = 1
        self.checks_due = 0
        self.acceptance.forget(self.o.request_carryover)
        self.drift.reset()
        self.repeats.reset()
        self.repeat_gap = self.o.probe_interval
        self.requests_waited += 1
        if self.mode == "fallback" and self.o.probe_each_request and self.requests_waited >= self.request_gap:
            # a new request may be easier (its first tokens are atypical, so not at once); with a
            # request_probe_gap, failed request-start probes make later requests probe less often
            self.countdown = min(self.countdown, self.o.request_probe_delay + 1)
            self.requests_waited = 0
            self.request_probe = True
            self.request_probes_left = self.o.request_probes - 1

    def _plain(self, reason: str) -> bool:
        self.action = reason
        return False

    def _event(self, mode: str, reason: str, est: Estimate | None) -> None:
        event = {"cycle": self.cycle, "mode": mode, "reason": reason, "context_length": self.context_length}
        if est is not None:
            event.update(plain_tok_s=round(est.plain_rate, 2), speculative_tok_s=round(est.spec_rate, 2), best_width=est.spec_width)
        self.events.append(event)


def best_rate(gains: Sequence[float], costs: Sequence[float], draft: float, rest: float) -> tuple[float, int]:
    """The best speculative tokens per second and its n >= 1: max_n E(n) / (D + T(n+1) + R).

    ``gains[n]`` = E(n), ``costs[n]`` = T(n+1); ties go to the smaller n.
    """
    best, best_n = 0.0, 0
    for n in range(1, len(gains)):
        rate = gains[n] / max(draft + costs[n] + rest, 1e-12)
        if rate > best * (1.0 + 1e-12):
            best, best_n = rate, n
    return best, best_n


def best_width(gains: Sequence[float], costs: Sequence[float], rate: float) -> int:
    """The n in 0..k maximising E(n) - rate * T(n+1) (ties go to the smaller n)."""
    best, best_value = 0, gains[0] - rate * costs[0]
    for n in range(1, len(gains)):
        value = gains[n] - rate * costs[n]
        if value > best_value + 1e-12 * max(1.0, abs(best_value)):
            best, best_value = n, value
    return best
