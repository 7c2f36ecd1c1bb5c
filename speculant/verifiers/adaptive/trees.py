"""The adaptive verifier's tree arms: per drafted cycle, the chain (the policy's width) or a tree
of one of ``tree_budgets`` nodes, whichever has emitted the most tokens per second so far.

The choice is the ``tree`` verifier's :class:`CostChoice` over more arms; it reads finished
cycles only, and a tree is verified by sample and match (exact however it was built), so the
output keeps the target's distribution whichever arm runs. A tree cycle is outside the chain
policy: its accepted depth and its forward's cost teach the chain models nothing.
"""

from __future__ import annotations

import time
from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.tree import DraftTree
from speculant.core.types import Draft, DraftSource, SamplingParams, Verification
from speculant.verifiers.tree import draft_tree, tree_verify
from speculant.verifiers.tree_verifier import CostChoice, TreeStats

CHAIN = "chain"


class TreeArms:
    """Chooses chain or tree per drafted cycle and builds / verifies the tree; its own seconds
    (the top-K transfer and the walk) count towards the tree arm's cost."""

    def __init__(self, budgets: list[int], width: int, explore_every: int) -> None:
        self.budgets = {f"tree{b}": b for b in dict.fromkeys(budgets)}
        self.width = width
        self.choice = CostChoice(explore_every, (CHAIN, *self.budgets))
        self.fallback: str | None = None
        self.stats = TreeStats()
        self.arm: str | None = None  # this cycle's, from plan() to observe()
        self.host_s = 0.0
        self.depth = 0  # the last tree's deepest node
        self.preset: str | None = None  # an arm chosen before drafting (tree_next), for choose()
        self.copy = False  # this cycle's tree carries a prompt-lookup copy, or its chain is one
        self.chain_width: int | None = None  # the drafts the policy last verified as a chain
        self._copy_nodes: list[int] = []
        self._branch: tuple[int, ...] | None = None
        self.no_distributions = False  # the drafter's drafts carry no per-position distributions

    def begin(self) -> None:
        self.stats, self.arm, self.preset = TreeStats(), None, None

    def choose_early(self, copy: bool) -> bool:
        """Before drafting: choose this cycle's arm now (``copy``: beside a prompt-lookup copy, whose
        chain is the copy); True for a tree. The chain arm is whatever the chain policy then does,
        a plain step included, so a tree also competes with plain decoding."""
        self.arm = None
        self.preset = None if self.fallback is not None or self.no_distributions else self.choice.next(copy)
        self.copy = copy
        return self.tree_preset

    @property
    def tree_preset(self) -> bool:
        """Whether the arm chosen before drafting is a tree (it is built over the whole block)."""
        return self.preset is not None and self.preset != CHAIN

    def choose(self, draft: Draft | None) -> str | None:
        """This drafted cycle's arm (the one chosen before drafting; else chosen now if the chain
        policy speculates), or None when no tree can be built (no per-position distributions, a
        target without tree forwards, no speculation: ``draft`` None)."""
        preset, self.preset = self.preset, None
        self.host_s = 0.0
        eligible = self._eligible(draft)
        if preset is None:
            self.copy = False
            preset = self.choice.next() if eligible else None
        if preset == CHAIN or (preset is not None and eligible):
            self.arm = preset  # beside a copy, the chain arm's chain is the copy
        else:
            self.arm = None
            if draft is not None and draft.source is DraftSource.MODEL and draft.logits is None:
                self.no_distributions = True  # this drafter's drafts carry none: trees never
        return self.arm

    def plain_step(self) -> None:
        """The chain arm's cycle was a plain step (the policy drafted nothing): it counts as such."""
        if self.preset == CHAIN:
            self.preset, self.arm, self.host_s = None, CHAIN, 0.0

    def _eligible(self, draft: Draft | None) -> bool:
        return (draft is not None and self.fallback is None and draft.logits is not None
                and draft.source is DraftSource.MODEL and draft.num_tokens >= 1)

    @property
    def tree_chosen(self) -> bool:
        return self.arm is not None and self.arm != CHAIN

    def tree(self, ops: ArrayOps, draft: Draft, anchor_id: int, budget: int | None = None) -> DraftTree | None:
        if not self.tree_chosen or draft.logits is None:
            return None
        start = time.perf_counter()
        nodes = self.budgets[self.arm] if budget is None else min(self.budgets[self.arm], budget)
        tree, self._copy_nodes = draft_tree(ops, draft, anchor_id, nodes, self.width)
        self._branch = draft.branch_ids
        self.depth = max(tree.depths)
        self.host_s += time.perf_counter() - start
        return tree

    def verify(self, ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams,
               rng: Any) -> Verification:
        start = time.perf_counter()
        verification = tree_verify(ops, tree, target_logits, sampling, rng, self._branch)
        self.host_s += time.perf_counter() - start
        self.stats.record(tree, verification.path, self._copy_nodes)
        return verification

    def observe(self, verification: Verification, submitted: int, seconds: float) -> None:
        """Record the finished cycle's tokens per second under its arm (a tree chosen but verified
        as a chain records nothing); the chain arm's plain steps count, at their own cost."""
        arm, self.arm = self.arm, None
        if arm is None or bool(verification.path) != (arm != CHAIN):
            return
        if arm == CHAIN:
            self.stats.chain_cycles += int(submitted > 0)
            if not self.copy:
                self.chain_width = submitted  # 0: the policy's plain step
        chain = verification.chain_accepted
        if chain is not None and not self.copy and self.chain_width is not None:
            chain = min(chain, self.chain_width)  # the chain verifies the policy's width, not the whole block
        self.choice.record(arm, len(verification.token_ids), seconds + self.host_s, self.copy,
                           None if chain is None else chain + 1)

    def as_dict(self) -> dict:
        record: dict = {"budgets": list(self.budgets.values()), "width": self.width, **self.stats.as_dict(),
                        "choice": self.choice.as_dict()}
        if self.fallback is not None:
            record["fallback"] = f"chains: {self.fallback}"
        return record
