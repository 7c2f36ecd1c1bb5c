"""The speculative-sampling verifier: lossless at any temperature, greedy rule at 0."""

from __future__ import annotations

from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.interfaces import Verifier
from speculant.core.types import Draft, PendingVerification, ProposalKind, SamplingParams, Verification
from speculant.verifiers.acceptance import chain_pending, speculative_verify


class SpeculativeSamplingVerifier(Verifier):
    """Accept draft x_i with probability min(1, p_i(x_i) / q_i(x_i)), resample the residual.

    Handles one-hot (argmax) drafts, dense q [k, V] and sparse q [k, C] over candidate ids.
    At temperature 0 it applies exactly the greedy rule and consumes no randomness.
    """

    name = "speculative_sampling"
    accepts = (ProposalKind.ONE_HOT, ProposalKind.DENSE, ProposalKind.SPARSE)
    supports_sampling = True

    def verify(
        self,
        ops: ArrayOps,
        draft: Draft | None,
        target_logits: Array,
        sampling: SamplingParams,
        rng: Any,
    ) -> Verification:
        return speculative_verify(ops, draft, target_logits, sampling, rng)

    def pending(self, ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams,
                rng: Any) -> PendingVerification | None:
        return chain_pending(ops, draft, target_logits, sampling)
