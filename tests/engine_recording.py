"""Run an engine while recording what its drafter proposed in each cycle (for parity tests)."""

from __future__ import annotations


def run_recording_proposals(engine, **kwargs):
    """``(engine.run(**kwargs), proposals per cycle as lists of token ids)``."""
    proposals = []
    propose = engine.drafter.propose

    def recording(request):
        draft = propose(request)
        proposals.append(engine.backend.ops.to_list(draft.token_ids))
        return draft

    engine.drafter.propose = recording
    try:
        return engine.run(**kwargs), proposals
    finally:
        del engine.drafter.propose
