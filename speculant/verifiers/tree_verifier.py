"""The ``tree`` verifier: DDTree trees from a block drafter's per-position distributions, verified
by sample and match (exact at every temperature); chains where no tree can be built."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from speculant.core.arrays import Array, ArrayOps
from speculant.core.interfaces import Verifier
from speculant.core.schema import UserModel
from speculant.core.tree import DraftTree
from speculant.core.types import CycleTiming, Draft, ProposalKind, SamplingParams, Verification
from speculant.verifiers.acceptance import speculative_verify
from speculant.verifiers.tree import build_tree, top_candidates, tree_verify


class TreeOptions(UserModel):
    """``verifier.options`` of the ``tree`` verifier."""

    budget: int = Field(16, ge=1, le=1024, description="drafted nodes per tree (B), the root not counted")
    width: int = Field(4, ge=1, le=64, description="most candidates per depth (K): the draft's K most probable tokens")


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
        self.fallback: str | None = None
        self._stats = TreeStats()

    def begin(self, context_length: int) -> None:
        self._stats = TreeStats()  # the statistics are each request's own

    def tree(self, ops: ArrayOps, draft: Draft, anchor_id: int) -> DraftTree | None:
        if self.fallback is not None or draft.logits is None or draft.num_tokens < 1:
            return None
        top_ids, top_logprobs = top_candidates(ops, draft.logits[: draft.num_tokens], self.width)
        return build_tree(anchor_id, top_ids, top_logprobs, self.budget)

    def verify(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
               rng: Any) -> Verification:
        return speculative_verify(ops, draft, target_logits, sampling, rng)

    def verify_tree(self, ops: ArrayOps, tree: DraftTree, target_logits: Array, sampling: SamplingParams,
                    rng: Any) -> Verification:
        verification = tree_verify(ops, tree, target_logits, sampling, rng)
        self._stats.record(tree, verification.path)
        return verification

    def tree_refused(self, reason: str) -> None:
        self.fallback = reason

    def observe(self, verification: Verification, submitted: int, timing: CycleTiming | None = None) -> None:
        if submitted > 0 and not verification.path:
            self._stats.chain_cycles += 1

    def decisions(self) -> dict:
        record = {"budget": self.budget, "width": self.width, **self._stats.as_dict()}
        if self.fallback is not None:
            record["fallback"] = f"chains: {self.fallback}"
        return record


class TreeStats:
    """Per request: nodes verified, the accepted depth of every tree, and at each depth how often the
    accepted node was not its parent's first child (a branch the chain would not have had)."""

    def __init__(self) -> None:
        self.trees = 0
        self.chain_cycles = 0
        self.nodes_verified = 0
        self.accepted_depths: list[int] = []
        self.branch_used_per_depth: list[int] = []

    def record(self, tree: DraftTree, path: tuple[int, ...]) -> None:
        self.trees += 1
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
        }
