"""The adaptive verifier: picks the verify width per cycle, falls back to plain decoding when
speculation does not pay on this machine, and stays lossless.

Acceptance is delegated unchanged to the shared rules in :mod:`speculant.verifiers.acceptance`
(the greedy rule at temperature 0, speculative sampling otherwise). What this verifier adds is
*how many* drafted tokens go to the target, chosen by :class:`AdaptivePolicy` from draft-side
information and finished cycles only, before the target forward runs. The number verified is
therefore a stopping time independent of the cycle's acceptance draws, and every emitted token
keeps the target's distribution (greedy outputs are token-for-token those of plain decoding).
Prompt-lookup copies (``DraftSource.LOOKUP``) are verified whole and teach the policy nothing:
it models the drafter.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.interfaces import Verifier
from speculant.core.tree import DraftTree
from speculant.core.types import (CycleTiming, Draft, DraftSource, PendingVerification, ProposalKind, SamplingParams,
                                  Verification)
from speculant.verifiers.acceptance import greedy_pending, speculative_verify
from speculant.verifiers.adaptive.options import AdaptiveOptions
from speculant.verifiers.adaptive.policy import AdaptivePolicy
from speculant.verifiers.adaptive.states import Action, Mode
from speculant.verifiers.adaptive.trees import TreeArms


@dataclass
class RequestLog:
    """What the current request's cycles were, for ``decisions()``."""

    widths: list[int] = field(default_factory=list)  # drafts submitted per cycle (0 = plain target step)
    actions: list[Action] = field(default_factory=list)
    plain_from_context: int | None = None  # the context length from which max_context made it plain


class AdaptiveVerifier(Verifier):
    """Greedy / speculative-sampling verification with a per-cycle width from a measured cost model.

    Options (``verifier.options``) are :class:`AdaptiveOptions`; ``max_context`` makes every
    request decode plainly from that context length on. ``decisions()`` (``stats.verifier``)
    lists the drafts submitted per cycle (``widths``; 0 = plain target step), what each cycle
    was (``actions``), fallback cycles by reason, mode switches with the rates behind them, and
    the final acceptance and cost estimates.
    """

    name = "adaptive"
    accepts = (ProposalKind.ONE_HOT, ProposalKind.DENSE, ProposalKind.SPARSE)
    supports_sampling = True
    needs_timings = True  # its cost model learns from the measured seconds
    allows_draft_ahead = False  # it chooses each width from the verifications before it
    options_model = AdaptiveOptions

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        self.settings = AdaptiveOptions.model_validate(self.options)
        self.max_context = self.settings.max_context
        self.policy = AdaptivePolicy(self.settings)
        o = self.settings
        self.trees = TreeArms(o.tree_budgets, o.tree_width, o.tree_explore_every) if o.tree == "auto" else None
        self.builds_trees = self.trees is not None
        self.tree_budgets = tuple(self.trees.budgets.values()) if self.trees is not None else ()
        self._verify_s = 0.0
        self.in_batch = False  # verifying in a batch (batched)
        self.begin(0)

    # -- the engine's hooks, in cycle order --------------------------------------------------
    def begin(self, context_length: int) -> None:
        self.policy.begin()
        if self.trees is not None:
            self.trees.begin()
        limit = self.max_context
        self.log = RequestLog(plain_from_context=context_length if limit is not None and context_length >= limit else None)

    def batched(self, on: bool) -> None:
        """In a batch the scheduler's plan gives each row its width from the batched forward's cost
        (every request's warm-up and probes here priced the batch's cycles as one request's: 31
        of 32 rows of the mid pair took a warm-up plain step together beside one row drafting, a
        16-wide cycle for 47 tokens); so the chain policy only learns acceptance there. Trees keep
        their own choice."""
        self.in_batch = on and self.trees is None

    def wants_draft(self, max_tokens: int, context_length: int) -> bool:
        if self.in_batch:
            return True
        if self.trees is not None and self.trees.choose_early(copy=False):
            return True  # a tree's cycle: outside the chain policy, which may have gone plain
        wanted = self.policy.wants_draft(max_tokens, context_length)
        if not wanted and self.trees is not None:
            self.trees.plain_step()
        return wanted

    def draft_length(self, max_tokens: int, context_length: int) -> int:
        if self.in_batch:
            return max_tokens
        if self.trees is not None and self.trees.tree_preset:
            return max_tokens  # a tree is built over the whole block
        return self.policy.draft_length(max_tokens)

    def plan(self, draft: Draft | None, max_tokens: int, context_length: int) -> int:
        if draft is None:
            return 0
        if self.trees is not None:  # the arm: from finished cycles only, like the width below
            chosen = self.trees.preset is not None or draft.source is DraftSource.LOOKUP
            self.trees.choose(draft if chosen or self.policy.speculating(max_tokens, context_length) else None)
            if self.trees.tree_chosen:  # the tree's budget bounds it, not the chain's width
                return min(draft.num_tokens, max_tokens)
        if draft.source == DraftSource.LOOKUP:  # a copy: verified whole, outside the policy
            return min(draft.num_tokens, max_tokens)
        if self.in_batch:
            return self.policy.plan_given(min(draft.num_tokens, max_tokens))
        # A sampled draft's confidence is its own q(x_i): choosing whether to verify x_i from the
        # value x_i took biases the output (with q = (.5, .5), p = (.9, .1) and "verify x only
        # when x = 0", token 0 comes out 95 % of the time). Widths then come from history alone;
        # an argmax draft's confidence is a function of the context, which is safe.
        confidence = None if draft.draft_probs is not None else host_confidence(draft.confidence)
        return self.policy.plan(draft.num_tokens, max_tokens, context_length, confidence)

    def verify(
        self,
        ops: ArrayOps,
        draft: Draft | None,
        target_logits: Array,
        sampling: SamplingParams,
        rng: Any,
    ) -> Verification:
        start = time.perf_counter()
        verification = speculative_verify(ops, draft, target_logits, sampling, rng)
        self._verify_s = time.perf_counter() - start
        return verification

    def pending(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
                rng: Any) -> PendingVerification | None:
        if not sampling.is_greedy:
            return None
        start = time.perf_counter()
        half = greedy_pending(ops, draft, target_logits)
        launched = time.perf_counter() - start

        def finish(host: list[float]) -> Verification:  # the shared transfer is the batch's, not timed here
            begun = time.perf_counter()
            verification = half.finish(host)
            self._verify_s = launched + time.perf_counter() - begun
            return verification

        return PendingVerification(half.parts, finish)

    def tree_next(self) -> bool:
        return self.trees is not None and self.trees.choose_early(copy=True)

    def tree(self, ops: ArrayOps, draft: Draft, anchor_id: int, budget: int | None = None) -> DraftTree | None:
        return None if self.trees is None else self.trees.tree(ops, draft, anchor_id, budget)

    def verify_tree(self, ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams,
                    rng: Any) -> Verification:
        return self.trees.verify(ops, tree, target_logits, sampling, rng)

    def tree_refused(self, reason: str) -> None:
        if self.trees is not None:
            self.trees.fallback = reason

    def observe(self, verification: Verification, submitted: int, timing: CycleTiming | None = None) -> None:
        if self.trees is not None:
            seconds = 0.0 if timing is None else timing.target_s + timing.draft_s + timing.commit_s
            self.trees.observe(verification, submitted, seconds + (0.0 if verification.path else self._verify_s))
        if timing is not None and timing.source == DraftSource.LOOKUP:
            return  # a copy says nothing about the drafter's acceptance, nor about this policy's choices
        if verification.path:
            action = self.policy.tree_done(verification.token_ids)
        elif self.in_batch:  # acceptance only: the batch's seconds are not this policy's costs
            self.policy.observe(submitted, verification.accepted, None, 0.0, verification.token_ids)
            action = Action.BATCHED
        else:
            action = self.policy.observe(submitted, verification.accepted, timing, self._verify_s, verification.token_ids)
        log = self.log
        log.widths.append(self.trees.depth if verification.path else submitted)  # a tree: its depth
        log.actions.append(action)
        limit = self.max_context
        if limit is not None and log.plain_from_context is None and timing is not None and timing.context_length >= limit:
            log.plain_from_context = timing.context_length

    # -- stats -------------------------------------------------------------------------------
    def decisions(self) -> dict:
        p, log = self.policy, self.log
        fallback = Counter(a.reason for a in log.actions if a.plain)
        chain_widths = [w for w, a in zip(log.widths, log.actions) if a is not Action.TREE]
        k = max(chain_widths, default=0) or p.request.k
        return {
            "policy": "adaptive",
            "widths": list(log.widths),
            "actions": [a.value for a in log.actions],
            "speculative_cycles": sum(1 for w in log.widths if w > 0),
            "probe_cycles": log.actions.count(Action.PROBE),
            "fallback_cycles": dict(fallback),
            "events": list(p.request.events),
            "mode": p.mode.value,
            "next_probe_in": p.probes.countdown if p.mode is Mode.FALLBACK else None,
            "max_context": self.max_context,
            "plain_from_context": log.plain_from_context,
            "acceptance": p.acceptance.snapshot(k),
            "cost": p.costs.snapshot(k + 1, p.request.context_length),
            "tree": None if self.trees is None else self.trees.as_dict(),
        }


def host_confidence(confidence: Any) -> list[float | None] | None:
    """Draft confidences as host floats: a list, a NumPy array or a backend array (``tolist``)."""
    if confidence is None:
        return None
    values = confidence.tolist() if hasattr(confidence, "tolist") else list(confidence)
    if not isinstance(values, list):  # a 0-d array
        values = [values]
    out: list[float | None] = []
    for v in values:
        while isinstance(v, (list, tuple)) and len(v) == 1:
            v = v[0]
        try:
            out.append(float(v))
        except (TypeError, ValueError):
            out.append(None)
    return out
