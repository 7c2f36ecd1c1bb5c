"""The greedy verifier: exact token-for-token agreement with plain greedy decoding."""

from __future__ import annotations

from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.interfaces import Verifier
from speculant.core.types import Draft, ProposalKind, SamplingParams, Verification
from speculant.verifiers.acceptance import greedy_verify


class GreedyVerifier(Verifier):
    """Accept the longest prefix of drafts equal to the target's argmax (temperature 0 only).

    It ignores the draft distribution, so it accepts every proposal kind.
    """

    name = "greedy"
    accepts = (ProposalKind.ONE_HOT, ProposalKind.DENSE, ProposalKind.SPARSE)
    supports_sampling = False

    def verify(
        self,
        ops: ArrayOps,
        draft: Draft | None,
        target_logits: Array,
        sampling: SamplingParams,
        rng: Any,
    ) -> Verification:
        if not sampling.is_greedy:
            raise ValueError(
                f"the greedy verifier only supports temperature 0, but sampling.temperature is {sampling.temperature}; "
                "use verifier.kind = 'speculative_sampling' (or 'auto') to sample"
            )
        return greedy_verify(ops, draft, target_logits)
