"""The ``tree`` verifier: DDTree trees from a block drafter's per-position distributions, verified
by sample and match (exact at every temperature); chains where no tree can be built."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from speculant.core.arrays import Array, ArrayOps
from speculant.core.interfaces import Verifier
from speculant.core.schema import COUNT_MAX, UserModel
from speculant.core.tree import DraftTree
from speculant.core.types import CycleTiming, Draft, DraftSource, ProposalKind, SamplingParams, Verification
from speculant.verifiers.acceptance import speculative_verify
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
        self.shape = TreeShape(settings.scores)
        self.fallback: str | None = None
        self._stats = TreeStats()
        self.choice = CostChoice(settings.explore_every) if settings.choose == "measured" else None
        self.needs_timings = self.choice is not None  # the choice compares measured seconds
        self._next: str | None = None  # a kind decided by tree_next, for tree()
        self._copy_nodes: list[int] = []
        self._copy_chain = False

    def begin(self, context_length: int) -> None:
        self._stats = TreeStats()  # the statistics are each request's own

    def tree_next(self) -> bool:
        if self.fallback is not None:
            return False
        self._next = "tree" if self.choice is None else self.choice.next()
        return self._next == "tree"

    def tree(self, ops: ArrayOps, draft: Draft, anchor_id: int) -> DraftTree | None:
        decided, self._next = self._next, None
        # chain chosen beside a copy: the copy is this cycle's chain, measured as one
        self._copy_chain = decided == "chain" and draft.source is DraftSource.LOOKUP
        if self.fallback is not None or draft.logits is None or draft.num_tokens < 1:
            return None
        if (decided or (self.choice.next() if self.choice is not None else "tree")) == "chain":
            return None
        tree, self._copy_nodes = draft_tree(ops, draft, anchor_id, self.budget, self.width, self.shape)
        return tree

    def verify(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
               rng: Any) -> Verification:
        return speculative_verify(ops, draft, target_logits, sampling, rng)

    def verify_tree(self, ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams,
                    rng: Any) -> Verification:
        verification = tree_verify(ops, tree, target_logits, sampling, rng)
        self._stats.record(tree, verification.path, self._copy_nodes)
        return verification

    def tree_refused(self, reason: str) -> None:
        self.fallback = reason

    def observe(self, verification: Verification, submitted: int, timing: CycleTiming | None = None) -> None:
        copy_chain, self._copy_chain = self._copy_chain, False
        if submitted <= 0 or (timing is not None and timing.source is DraftSource.LOOKUP and not copy_chain):
            return
        kind = "tree" if verification.path else "chain"
        if kind == "chain":
            self._stats.chain_cycles += 1
        if self.choice is not None and timing is not None:
            self.choice.record(kind, len(verification.token_ids), timing.target_s + timing.draft_s + timing.commit_s)

    def decisions(self) -> dict:
        record = {"budget": self.budget, "width": self.width, "scores": self.shape.scores, **self._stats.as_dict()}
        if self.fallback is not None:
            record["fallback"] = f"chains: {self.fallback}"
        if self.choice is not None:
            record["choice"] = self.choice.as_dict()
        return record


class CostChoice:
    """Which of ``arms`` (e.g. ``("tree", "chain")``) runs the next drafted cycle, from the tokens
    each has emitted per second (exponential moving averages over this engine's requests): each
    arm first runs ``WARMUP`` times, in order; then the fastest runs, and every
    ``explore_every``-th cycle one of the slower ones (in turn), so their costs stay known. It
    reads only finished cycles, so a choice never depends on the cycle it is made for."""

    WARMUP = 3
    ALPHA = 0.2  # weight of a new measurement

    def __init__(self, explore_every: int, arms: tuple[str, ...] = ("tree", "chain")) -> None:
        self.explore_every = explore_every
        self.arms = arms
        self.rate: dict[str, float | None] = {a: None for a in arms}
        self.measured = {a: 0 for a in arms}
        self.chosen = {a: 0 for a in arms}
        self.cycles = 0
        self.explored = 0

    def next(self) -> str:
        self.cycles += 1
        arm = next((a for a in self.arms if self.measured[a] < self.WARMUP), None)
        if arm is None:
            ranked = sorted(self.arms, key=lambda a: -self.rate[a])  # stable: ties keep the arms' order
            arm = ranked[0]
            if self.cycles % self.explore_every == 0 and len(ranked) > 1:
                self.explored += 1
                arm = ranked[1 + (self.explored - 1) % (len(ranked) - 1)]
        self.chosen[arm] += 1
        return arm

    def record(self, arm: str, emitted: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        rate, old = emitted / seconds, self.rate[arm]
        self.rate[arm] = rate if old is None else old + self.ALPHA * (rate - old)
        self.measured[arm] += 1

    def as_dict(self) -> dict:
        return {"tokens_per_s": dict(self.rate), "chosen": dict(self.chosen)}


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
