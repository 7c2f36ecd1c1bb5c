"""Built-in verifiers, registered through the same hook third-party plugins use."""

from __future__ import annotations

from speculant.plugin_api import hookimpl
from speculant.verifiers.adaptive import AdaptiveVerifier
from speculant.verifiers.greedy import GreedyVerifier
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier
from speculant.verifiers.tree_verifier import TreeVerifier


@hookimpl
def register_verifiers(register):
    register(GreedyVerifier)
    register(SpeculativeSamplingVerifier)
    register(AdaptiveVerifier)
    register(TreeVerifier)
