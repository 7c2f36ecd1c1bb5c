"""Verifiers: decide which drafted tokens to keep, losslessly."""

from speculant.verifiers.greedy import GreedyVerifier
from speculant.core.sampling import inverse_cdf, sample_token, target_probs
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier

__all__ = ["GreedyVerifier", "SpeculativeSamplingVerifier", "inverse_cdf", "sample_token", "target_probs"]
