"""Test fixture for ``speculant check``: two verifiers a check must not pass. ``accept_all``
keeps every drafted token (wrong tokens reach the output); ``never_draft`` never asks for a
draft, so speculative decoding is plain decoding and the greedy check tests nothing. Loaded with
``-p speculant_broken_verifier`` (tests/test_check.py puts this folder on sys.path)."""

from speculant.plugin_api import Verification, Verifier, hookimpl


class AcceptAll(Verifier):
    name = "accept_all"

    def verify(self, ops, draft, target_logits, sampling, rng):
        drafted = [] if draft is None else ops.to_list(draft.token_ids)
        bonus = int(ops.to_list(ops.argmax(target_logits[len(drafted):len(drafted) + 1]))[0])
        return Verification(len(drafted), drafted + [bonus])


class NeverDraft(AcceptAll):
    name = "never_draft"

    def wants_draft(self, max_tokens, context_length):
        return False


@hookimpl
def register_verifiers(register):
    register(AcceptAll)
    register(NeverDraft)
