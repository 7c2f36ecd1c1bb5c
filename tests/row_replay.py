"""Replaying solo recordings of drafter calls into forks in lockstep (tests/test_draft_rows.py,
tests/test_mtp_rows.py): each row takes in its recorded commits up to its next proposal, and the
rows that propose are asked together."""

from __future__ import annotations

import copy
from typing import Callable


def replay_rounds(engine, calls: list[list[tuple]], ask, narrow: Callable[[int, int], int] | None = None):
    """Replay every recording (``test_drafter_fork.solo``'s) into its own fork (the engine's
    drafter for the first), each round's proposals through one ``ask(drafters, requests)``; row
    ``r`` asks ``narrow(r, num_tokens)`` tokens where given. Returns each round's
    (row, draft, recorded result, tokens it asked for in its recording) tuples."""
    drafters = [engine.drafter] + [engine.drafter.fork() for _ in calls[1:]]
    at, rounds = [0] * len(calls), []
    while True:
        asking = []
        for r, recorded in enumerate(calls):
            while at[r] < len(recorded) and recorded[at[r]][0] != "propose":
                name, args, _ = recorded[at[r]]
                getattr(drafters[r], name)(*copy.deepcopy(args))
                at[r] += 1
            if at[r] < len(recorded):
                asking.append(r)
        if not asking:
            return rounds
        requests = [copy.deepcopy(calls[r][at[r]][1][0]) for r in asking]
        wanted = [request.num_tokens for request in requests]
        for r, request in zip(asking, requests):
            request.num_tokens = narrow(r, request.num_tokens) if narrow else request.num_tokens
        got = ask([drafters[r] for r in asking], requests)
        rounds.append([(r, draft, calls[r][at[r]][2], want) for r, draft, want in zip(asking, got, wanted)])
        for r in asking:
            at[r] += 1
