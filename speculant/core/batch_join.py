"""Sequences joining a batch (core/batch.py): which prompts prefill together, the blocks that
prefill them, and a join spread over several cycles so a long prompt does not stall the others."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generator, Hashable, Iterator, Sequence

from speculant.core.prefix_cache import CacheSnapshot
from speculant.core.types import ForwardOutput

if TYPE_CHECKING:
    from speculant.core.batch import BatchedTarget

Restored = tuple[CacheSnapshot, int]  # a stored snapshot, and how many leading prompt tokens it restores
Join = tuple[Hashable, Sequence[int], "Restored | None"]  # a sequence joining: key, prompt, restored prefix
JoinSteps = Generator[None, None, ForwardOutput]  # runs a chunk per step; returns the output once the row is added


def check_prompt(key: Hashable, token_ids: Sequence[int], restored: Restored | None) -> None:
    start = 0 if restored is None else restored[1]
    if len(token_ids) <= start:
        raise ValueError(f"sequence {key!r} has an empty prompt; give it at least one token" if not start else
                         f"sequence {key!r} has no prompt token after its {start} restored ones; give it one more")


def join_groups(lengths: Sequence[int], budget: int, equal: bool = False) -> list[list[int]]:
    """Which joining prompts prefill together: index groups, in order of their first member.
    Prompts of length 0 (the other kind of join) are left out; those of one token (a repeated
    prompt resuming its stored prefix) group among themselves only, so that no row of a group
    starts with nothing to run. The others, shortest first, fill a group while its padded size
    (members x longest) stays within ``budget`` tokens and at most twice its real tokens (padding
    costs compute); with ``equal``, only equal lengths group."""
    groups: list[list[int]] = []
    group: list[int] = []
    for i in sorted((i for i, n in enumerate(lengths) if n >= 1), key=lambda i: lengths[i]):
        n, real = lengths[i], sum(lengths[j] for j in group) + lengths[i]
        first = lengths[group[0]] if group else n
        fits = (len(group) + 1) * n <= min(budget, 2 * real) and (first == 1) == (n == 1) and (not equal or first == n)
        if group and not fits:
            groups.append(group)
            group = []
        group.append(i)
    if group:
        groups.append(group)
    return sorted(groups, key=min)


def join_plan(joins: Sequence[Join], budget: int, equal: bool = False) -> list[list[int]]:
    """:func:`join_groups` of ``joins`` by the tokens each has to run: those with nothing restored
    group among themselves, and so do those restoring a stored prefix (each row after its own
    restored positions); in order of their first member."""
    fresh = [len(t) if r is None else 0 for _, t, r in joins]
    rest = [0 if r is None else len(t) - r[1] for _, t, r in joins]
    groups = [g for g in join_groups(fresh, budget, equal) if joins[g[0]][2] is None]
    groups += [g for g in join_groups(rest, budget, equal) if joins[g[0]][2] is not None]
    return sorted(groups, key=min)


def prefill_blocks(prompts: Sequence[Sequence[int]], step: int) -> Iterator[list[list[int]]]:
    """The blocks that prefill ``prompts`` as rows of one batch: every prompt but its last token, in
    chunks of at most ``step`` columns (0: one chunk; a row that has run out gets an empty block),
    whose logits are not needed; then the last tokens, whose logits give each row its first token."""
    longest = max(len(p) for p in prompts) - 1
    for at in range(0, longest, step if step > 0 else max(longest, 1)):
        yield [list(p[at:min(at + step, len(p) - 1)]) for p in prompts]
    yield [[p[-1]] for p in prompts]



def run_steps(steps: Generator):
    """Every step of ``steps`` at once; its return value."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


class PendingJoin:
    """A sequence joining over several cycles (:meth:`BatchedTarget.begin_join`): each :meth:`step`,
    between cycles, runs one chunk of its prompt over a cache of its own; the last adds the row."""

    def __init__(self, batch: "BatchedTarget", key: Hashable, steps: JoinSteps) -> None:
        self.batch, self.key, self._steps = batch, key, steps
        self.output: ForwardOutput | None = None  # set once the row is in the batch

    def step(self) -> bool:
        """Run the next chunk; True once the row is in the batch (its output in :attr:`output`)."""
        self.batch._between_cycles("join")
        try:
            next(self._steps)
            return False
        except StopIteration as done:
            self.output = done.value
        self.batch.pending.discard(self.key)
        self.batch.keys.append(self.key)
        return True

    def cancel(self) -> None:
        """Give up the join: nothing of it is in the batch."""
        self._steps.close()
        self.batch.pending.discard(self.key)
