"""Test fixture: registers a verifier named ``greedy``, which the built-ins already provide,
plus a uniquely named one that must be taken back when the duplicate is rejected."""

from speculant.plugin_api import Verifier, hookimpl


class DupGreedy(Verifier):
    name = "greedy"

    def verify(self, ops, draft, target_logits, sampling, rng):  # pragma: no cover - never used
        raise NotImplementedError


class DupOnly(Verifier):
    name = "dup_only"

    def verify(self, ops, draft, target_logits, sampling, rng):  # pragma: no cover - never used
        raise NotImplementedError


@hookimpl
def register_verifiers(register):
    register(DupOnly)
    register(DupGreedy)
