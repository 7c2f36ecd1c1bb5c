"""The greedy verifier: speculative sampling restricted to temperature 0, where it is exact
token-for-token agreement with plain greedy decoding."""

from __future__ import annotations

from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.types import Draft, SamplingParams, Verification
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier


class GreedyVerifier(SpeculativeSamplingVerifier):
    """Accept the longest prefix of drafts equal to the target's argmax (temperature 0 only).

    It ignores the draft distribution, so it accepts every proposal kind.
    """

    name = "greedy"
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
        return super().verify(ops, draft, target_logits, sampling, rng)
