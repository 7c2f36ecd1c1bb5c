"""The ``tree`` verifier: DDTree trees from a block drafter's per-position distributions, verified
by sample and match (exact at every temperature); chains where no tree can be built."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from speculant.core.arrays import Array, ArrayOps
from speculant.core.interfaces import Verifier
from speculant.core.schema import COUNT_MAX, UserModel
from speculant.core.tree import DraftTree
from speculant.core.types import (CycleTiming, Draft, DraftSource, PendingVerification, ProposalKind, SamplingParams,
                                  Verification)
from speculant.verifiers.acceptance import chain_pending, speculative_verify
from speculant.verifiers.tree import TreeShape, draft_tree, tree_verify


class TreeOptions(UserModel):
    """``verifier.options`` of the ``tree`` verifier."""

    budget: int = Field(16, ge=1, le=1024, description="drafted nodes per tree (B), the root not counted")
    width: int = Field(8, ge=1, le=64, description="most candidates per depth (K): the draft's K most probable "
                       "tokens (with scores = selector: per parent, of the selector's candidates)")
    scores: Literal["marginal", "selector"] = Field(
        "selector", description="what ranks the tree's nodes: the draft's per-position distributions (marginal), or "
        "a path selector's scores of each candidate given its parent (selector: DFlash2's; drafts without them "
        "use the marginals)")
    choose: Literal["always", "measured"] = Field(
        "always", description="verify a tree every drafted cycle, or whichever of tree and chain has emitted more "
        "tokens per second of target and draft time so far (timed cycles, each tried now and then)")
    explore_every: int = Field(16, ge=2, le=COUNT_MAX, description="with choose = measured, every n-th drafted cycle "
                               "runs the kind measured slower, so its cost stays known")


class TreeVerifier(Verifier):
    """Verify a tree of the ``budget`` most probable draft prefixes in one target forward.

    Drafts without per-position distributions (prompt-lookup copies, drafters that offer none)
    and targets that cannot take a tree are verified as chains by speculative sampling."""

    name = "tree"
    accepts = (ProposalKind.ONE_HOT, ProposalKind.DENSE, ProposalKind.SPARSE)
    supports_sampling = True
    options_model = TreeOptions
    allows_draft_ahead = False  # the next tree depends on which path this one accepts
    builds_trees = True

    def __init__(self, options: dict | None = None) -> None:
        super().__init__(options)
        settings = TreeOptions(**self.options)
        self.budget, self.width = settings.budget, settings.width
        self.tree_budgets = (self.budget,)
        self.shape = TreeShape(settings.scores)
        self.fallback: str | None = None
        self._stats = TreeStats()
        self.choice = CostChoice(settings.explore_every) if settings.choose == "measured" else None
        self._copy = False  # this cycle's tree carries a prompt-lookup copy, or its chain is one
        self.needs_timings = self.choice is not None  # the choice compares measured seconds
        self._next: str | None = None  # a kind decided by tree_next, for tree()
        self._copy_nodes: list[int] = []
        self._branch: tuple[int, ...] | None = None
        self._copy_chain = False

    def begin(self, context_length: int) -> None:
        self._stats = TreeStats()  # the statistics are each request's own

    def tree_next(self) -> bool:
        if self.fallback is not None:
            return False
        self._next = "tree" if self.choice is None else self.choice.next(copy=True)
        return self._next == "tree"

    def tree(self, ops: ArrayOps, draft: Draft, anchor_id: int, budget: int | None = None) -> DraftTree | None:
        decided, self._next = self._next, None
        # chain chosen beside a copy: the copy is this cycle's chain, measured as one
        self._copy_chain = decided == "chain" and draft.source is DraftSource.LOOKUP
        self._copy = decided is not None
        if self.fallback is not None or draft.logits is None or draft.num_tokens < 1:
            return None
        if (decided or (self.choice.next() if self.choice is not None else "tree")) == "chain":
            return None
        nodes = self.budget if budget is None else min(self.budget, budget)
        tree, self._copy_nodes = draft_tree(ops, draft, anchor_id, nodes, self.width, self.shape)
        self._branch = draft.branch_ids
        return tree

    def verify(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
               rng: Any) -> Verification:
        return speculative_verify(ops, draft, target_logits, sampling, rng)

    def pending(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
                rng: Any) -> PendingVerification | None:
        return chain_pending(ops, draft, target_logits, sampling)

    def verify_tree(self, ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams,
                    rng: Any) -> Verification:
        verification = tree_verify(ops, tree, target_logits, sampling, rng, self._branch)
        self._stats.record(tree, verification.path, self._copy_nodes)
        return verification

    def tree_refused(self, reason: str) -> None:
        self.fallback = reason

    def observe(self, verification: Verification, submitted: int, timing: CycleTiming | None = None) -> None:
        copy_chain, self._copy_chain = self._copy_chain, False
        copy, self._copy = self._copy, False
        if submitted <= 0 or (timing is not None and timing.source is DraftSource.LOOKUP and not copy_chain):
            return
        kind = "tree" if verification.path else "chain"
        if kind == "chain":
            self._stats.chain_cycles += 1
        if self.choice is not None and timing is not None:
            chain = None if verification.chain_accepted is None else verification.chain_accepted + 1
            self.choice.record(kind, len(verification.token_ids), timing.target_s + timing.draft_s + timing.commit_s,
                               copy, chain)

    def decisions(self) -> dict:
        record = {"budget": self.budget, "width": self.width, "scores": self.shape.scores, **self._stats.as_dict()}
        if self.fallback is not None:
            record["fallback"] = f"chains: {self.fallback}"
        if self.choice is not None:
            record["choice"] = self.choice.as_dict()
        return record


SLOW_CYCLE = 4.0  # a cycle's seconds count at most this many times its arm's average
FAR_BEHIND = 0.5  # an arm below this share of the best's rate is explored at the widest spacing at once


class CostChoice:
    """Which of ``arms`` (the chain ``arms[0]``, then trees) runs the next drafted cycle.

    A tree's worth is paired, read off its own cycles: the tokens it emitted against those its chain
    path (the first children, or the prompt-lookup copy it carries) would have emitted from the same
    target picks, so a workload that accepts more or less moves both alike. An arm's cost is its
    cycles' seconds. Both are exponential moving averages over this engine's requests, kept apart
    for cycles beside a prompt-lookup copy (a chain there verifies the copy and runs no drafter).
    Each arm first runs ``WARMUP`` times, except that an arm whose first cycles put it under half
    the rate of an arm done warming stops there (a tree of 32 nodes on a CPU costs several chain
    cycles each time it runs); then the arm with the most tokens per second runs, and an
    arm measured slower runs again ``explore_every`` cycles later, that spacing doubling (up to
    ``BACKOFF_MOST`` times; at once for an arm at under half the best's rate) while it stays
    slower, back to ``explore_every`` when the best arm changes. A cycle's seconds count at most
    ``SLOW_CYCLE`` times its arm's average, so one compile does not price an arm. It reads only
    finished cycles, so a choice never depends on the cycle it is made for."""

    WARMUP = 3
    ALPHA = 0.2  # weight of a new measurement
    BACKOFF_MOST = 32

    def __init__(self, explore_every: int, arms: tuple[str, ...] = ("chain", "tree")) -> None:
        self.explore_every = explore_every
        self.arms = arms
        self.chosen = {a: 0 for a in arms}
        self.explored = 0
        self._sides = {copy: _Side(arms, explore_every, self.BACKOFF_MOST * explore_every) for copy in (False, True)}

    def next(self, copy: bool = False) -> str:
        side = self._sides[copy]
        side.cycles += 1
        rates = side.rates()
        arm = next((a for a in self.arms if side.warming(a, self.WARMUP) and not self._hopeless(side, a, rates)), None)
        if arm is None:
            best = arm = side.lead(rates)
            due = [a for a in self.arms if a != best and side.cycles >= side.explore_at[a]]
            if due:
                arm = min(due, key=side.explore_at.__getitem__)
                far_behind = (rates[arm] or 0.0) < FAR_BEHIND * (rates[best] or 0.0)
                side.spacing[arm] = side.most if far_behind else min(2 * side.spacing[arm], side.most)
                side.explore_at[arm] = side.cycles + side.spacing[arm]
                self.explored += 1
        self.chosen[arm] += 1
        return arm

    def _hopeless(self, side: "_Side", arm: str, rates: dict[str, float | None]) -> bool:
        """Whether ``arm``, measured at least once, is far behind an arm done warming (it then
        waits for the widest exploration spacing)."""
        warmed = [rates[a] or 0.0 for a in self.arms if not side.warming(a, self.WARMUP)]
        if not side.measured[arm] or not warmed or (rates[arm] or 0.0) >= FAR_BEHIND * max(warmed):
            return False
        side.warm_ended.add(arm)  # from now on it is explored like any slower arm
        side.spacing[arm] = side.most
        side.explore_at[arm] = side.cycles + side.most
        return True

    def record(self, arm: str, emitted: int, seconds: float, copy: bool = False,
               chain_emitted: int | None = None) -> None:
        """A finished cycle of ``arm``; for a tree, ``chain_emitted``: what its chain path would have
        emitted (None: unknown, the tree is then weighed against the chain's own cycles)."""
        if seconds > 0.0:
            self._sides[copy].record(arm, emitted, seconds, chain_emitted, self.ALPHA)

    @property
    def rate(self) -> dict[str, float | None]:
        """Tokens per second each arm is estimated to give (cycles without a copy)."""
        return self._sides[False].rates()

    def as_dict(self) -> dict:
        return {"tokens_per_s": self.rate, "tokens_per_s_beside_copy": self._sides[True].rates(),
                "chosen": dict(self.chosen), "explored": self.explored}


class _Side:
    """CostChoice's moving averages for one kind of cycle (with or without a prompt-lookup copy)."""

    def __init__(self, arms: tuple[str, ...], explore_every: int, most: int) -> None:
        self.arms, self.explore_every, self.most = arms, explore_every, most  # most: the widest spacing
        self.emitted: dict[str, float | None] = dict.fromkeys(arms)
        self.chain_emitted: dict[str, float | None] = dict.fromkeys(arms)
        self.seconds: dict[str, float | None] = dict.fromkeys(arms)
        self.measured = dict.fromkeys(arms, 0)
        self.warm_ended: set[str] = set()  # arms whose warm-up stopped early, far behind
        self.cycles = 0
        self.leader: str | None = None
        self.spacing = dict.fromkeys(arms, explore_every)
        self.explore_at = dict.fromkeys(arms, explore_every)

    def record(self, arm: str, emitted: int, seconds: float, chain_emitted: int | None, alpha: float) -> None:
        if self.seconds[arm] is not None:  # one slow cycle (a compile, a page fault) must not price an arm
            seconds = min(seconds, SLOW_CYCLE * self.seconds[arm])
        for table, value in ((self.emitted, emitted), (self.seconds, seconds), (self.chain_emitted, chain_emitted)):
            if value is not None:
                old = table[arm]
                table[arm] = float(value) if old is None else old + alpha * (value - old)
        self.measured[arm] += 1

    def warming(self, arm: str, cycles: int) -> bool:
        """Whether ``arm`` still has warm-up cycles to run (``cycles`` in all)."""
        return arm not in self.warm_ended and self.measured[arm] < cycles

    def rates(self) -> dict[str, float | None]:
        chain = self.arms[0]
        per_cycle = self.emitted[chain]
        out: dict[str, float | None] = {}
        for arm in self.arms:
            emitted, paired, seconds = self.emitted[arm], self.chain_emitted[arm], self.seconds[arm]
            if emitted is None or seconds is None:
                out[arm] = None
            elif arm == chain or paired is None or per_cycle is None:
                out[arm] = emitted / seconds
            else:  # the chain's tokens per cycle now, times what the tree added over its own chain path
                out[arm] = per_cycle * (emitted / paired) / seconds
        return out

    def lead(self, rates: dict[str, float | None]) -> str:
        """The arm with the best ``rates``; when it changes, every exploration spacing starts over
        (the widest for an arm under half its rate)."""
        best = max(self.arms, key=lambda a: rates[a] or 0.0)  # ties keep the arms' order: the chain first
        if best != self.leader:
            self.leader = best
            for arm in self.arms:
                far_behind = (rates[arm] or 0.0) < FAR_BEHIND * (rates[best] or 0.0)
                self.spacing[arm] = self.most if far_behind else self.explore_every
                self.explore_at[arm] = self.cycles + self.spacing[arm]
        return best


class TreeStats:
    """Per request: nodes verified, the accepted depth of every tree, and at each depth how often the
    accepted node was not its parent's first child (a branch the chain would not have had)."""

    def __init__(self) -> None:
        self.trees = 0
        self.chain_cycles = 0
        self.nodes_verified = 0
        self.accepted_depths: list[int] = []
        self.branch_used_per_depth: list[int] = []
        self.copy_branches = 0
        self.copy_nodes_accepted = 0

    def record(self, tree: DraftTree, path: tuple[int, ...], copy_nodes: list[int] = ()) -> None:
        """``copy_nodes``: the nodes only a prompt-lookup copy proposed."""
        self.trees += 1
        self.copy_branches += int(bool(copy_nodes))
        self.copy_nodes_accepted += len(set(path) & set(copy_nodes))
        self.nodes_verified += tree.size
        self.accepted_depths.append(len(path) - 1)
        children = tree.children()
        for depth, (parent, node) in enumerate(zip(path, path[1:]), start=1):
            while len(self.branch_used_per_depth) < depth:
                self.branch_used_per_depth.append(0)
            first_child = min(children[parent].values())
            self.branch_used_per_depth[depth - 1] += int(node != first_child)

    def as_dict(self) -> dict:
        depths = self.accepted_depths
        return {
            "trees": self.trees,
            "chain_cycles": self.chain_cycles,
            "nodes_verified": self.nodes_verified,
            "mean_accepted_depth": sum(depths) / len(depths) if depths else 0.0,
            "branch_used_per_depth": list(self.branch_used_per_depth),
            "copy_branches": self.copy_branches,
            "copy_nodes_accepted": self.copy_nodes_accepted,
        }
