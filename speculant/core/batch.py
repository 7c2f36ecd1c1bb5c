"""What a backend offers to verify several live sequences in one target forward (docs/batching.md).

The batch scheduler of issue #39 will stand on this: each cycle it verifies every sequence's
anchor + drafts (ragged widths) in one :meth:`BatchedTarget.verify` and rolls each sequence back to
its own accepted length with one :meth:`BatchedTarget.crop`; sequences join and leave between
cycles. Arrays are the backend's, handled through its ``ArrayOps`` as everywhere in core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Hashable, Sequence

from speculant.core.batch_book import RowBook
from speculant.core.batch_join import Join, JoinSteps, PendingJoin, Restored, check_prompt, join_plan
from speculant.core.prefix_cache import CacheSnapshot
from speculant.core.types import Capture, ForwardOutput, TargetInfo

if TYPE_CHECKING:
    from speculant.core.tree import DraftTree


_BATCHED_KINDS = ("full_attention", "sliding_attention", "linear_attention")


def batch_problem(info: TargetInfo) -> str | None:
    """Why the target's layers cannot be verified batched, or None (every backend batches the same kinds)."""
    refused = sorted({kind for kind in info.layer_types if kind not in _BATCHED_KINDS})
    if not refused:
        return None
    return (f"batched verify does not roll back {', '.join(refused)} layers per sequence yet "
            f"(target family {info.model_type}); it batches {', '.join(_BATCHED_KINDS)} only")


class BatchedTarget(ABC):
    """The live sequences of one batch over a loaded target; row ``i`` is sequence ``keys[i]``.
    Calls alternate: any joins and leaves, one verify, one crop, then again."""

    keys: list[Hashable]
    compact_at = 0.25  # squeeze the holes out once that frees this share of the columns
    padded = True  # a verify pads every row's block to the widest (rows x widest tokens computed)

    def __init__(self, target) -> None:
        problem = batch_problem(target.info)
        if problem is not None:
            raise ValueError(problem)
        self.target = target
        self.keys = []
        self.pending: set[Hashable] = set()  # sequences whose join is under way (begin_join)

    book: "RowBook"

    @property
    def lengths(self) -> list[int]:
        """Each sequence's cache length (positions held), in row order."""
        return self.book.lengths.tolist()

    def lengths_before_block(self) -> list[int]:
        """Each sequence's cache length before the last verified block."""
        if self.book.block is None:
            raise RuntimeError("no block was verified since the last crop")
        return self.book.block[0].tolist()

    def join(self, key: Hashable, token_ids: Sequence[int], capture: Capture = Capture(),
             restored: Restored | None = None) -> ForwardOutput:
        """Add sequence ``key`` as the last row, prefilled with ``token_ids``: the logits of its last
        position, the captured states of every position run. With ``restored`` (a snapshot that
        :meth:`can_restore` and its length ``n``), the row starts from the snapshot's first ``n``
        positions and only ``token_ids[n:]`` are run (the output covers those). Only between cycles."""
        return self.join_many([(key, token_ids, restored)], capture)[0]

    def join_many(self, joins: Sequence[Join], capture: Capture = Capture()) -> list[ForwardOutput]:
        """:meth:`join` for each of ``joins`` ((key, token_ids, restored) each), the outputs in
        their order. Short prompts are prefilled together, right-padded, in one forward a group
        (:func:`join_plan`; those restoring stored prefixes together, each after its own): a burst
        of requests costs a few forwards, not one each. The keys go into :attr:`keys` group by
        group, so read the rows' order from there."""
        keys = self._checked_joins(joins)
        outs: list[ForwardOutput | None] = [None] * len(joins)
        for group in join_plan(joins, self.join_tokens, equal=self._joins_need_equal_lengths()):
            if len(group) == 1:
                _, token_ids, restored = joins[group[0]]
                outs[group[0]] = self._join_row(token_ids, capture, restored)
            else:
                restored = [joins[i][2] for i in group]
                rows = self._join_rows([joins[i][1] for i in group], capture, None if restored[0] is None else restored)
                for i, out in zip(group, rows):
                    outs[i] = out
            self.keys += [keys[i] for i in group]
        return outs

    def begin_join(self, key: Hashable, token_ids: Sequence[int], capture: Capture = Capture(),
                   restored: Restored | None = None) -> PendingJoin:
        """:meth:`join` spread over cycles: each ``step()`` of the result runs ``join_tokens`` of the
        prompt (one step where the backend sets none), so the rows decode between its chunks."""
        self._checked_joins([(key, token_ids, restored)])
        self.pending.add(key)
        return PendingJoin(self, key, self._join_steps(token_ids, capture, restored))

    def _join_steps(self, token_ids: Sequence[int], capture: Capture, restored: Restored | None) -> JoinSteps:
        """:meth:`begin_join`'s chunks: a generator yielding after each, returning the output once the
        row is added; backends that chunk override it."""
        return self._join_row(token_ids, capture, restored)
        yield  # a generator with no chunk to wait between

    def join_snapshot(self, key: Hashable, snapshot: CacheSnapshot) -> bool:
        """Add sequence ``key`` as the last row holding all of ``snapshot``'s positions, with no
        forward: a sequence that ran on the target's own cache moves in as it stands (a copy of
        its caches, not a prefill of its context). False, with nothing added, where this batch
        cannot restore ``snapshot``. Only between cycles."""
        self._checked_keys([key])
        if not self.can_restore(snapshot):
            return False
        self._add_snapshot(snapshot, snapshot.length)
        self.keys.append(key)
        return True

    def _stored_rows(self, restored: list[Restored]) -> "BatchedTarget":
        """A batch of this kind holding each of ``restored``'s snapshots as a row, one below another,
        at its own length (a group of joins then prefills the rest of their prompts after them)."""
        group = type(self)(self.target)
        for key, (snapshot, length) in enumerate(restored):
            group._add_snapshot(snapshot, length)
            group.keys.append(key)
        return group

    def _add_snapshot(self, snapshot: CacheSnapshot, length: int) -> None:
        """A row holding ``snapshot``'s first ``length`` positions; backends whose
        :meth:`can_restore` says yes implement it."""
        raise NotImplementedError

    def _checked_joins(self, joins: Sequence[Join]) -> list[Hashable]:
        keys = self._checked_keys([key for key, _, _ in joins])
        for key, token_ids, restored in joins:
            check_prompt(key, token_ids, restored)
        return keys

    def _checked_keys(self, keys: list[Hashable]) -> list[Hashable]:
        for key in keys:
            if key in self.keys or key in self.pending or keys.count(key) > 1:
                raise ValueError(f"sequence {key!r} is already in the batch")
        self._between_cycles("join")
        return keys

    @abstractmethod
    def _join_row(self, token_ids: Sequence[int], capture: Capture, restored: Restored | None) -> ForwardOutput:
        """:meth:`join`'s work once the arguments are checked: the new row's caches and its output."""

    join_tokens = 0  # a joining group's padded tokens per forward (0: every sequence joins alone)

    def _join_rows(self, prompts: list[Sequence[int]], capture: Capture,
                   restored: list[Restored] | None = None) -> list[ForwardOutput]:
        """Rows for ``prompts`` (two or more, at least two tokens each to run) prefilled together,
        each after its ``restored`` prefix where given; each one's output as :meth:`_join_row`'s.
        Backends with ``join_tokens`` set implement it."""
        raise NotImplementedError

    def _joins_need_equal_lengths(self) -> bool:
        """Whether only prompts of one length prefill together (a recurrent layer's padding would move its state)."""
        return "linear_attention" in (self.target.info.layer_types or ())

    def can_restore(self, snapshot: CacheSnapshot) -> bool:
        """Whether :meth:`join` can start a row from ``snapshot`` (one the target took)."""
        return False

    def snapshot(self, key: Hashable) -> CacheSnapshot | None:
        """Row ``key``'s caches as a single-sequence snapshot in the format the target's own
        ``snapshot`` gives, so the prefix store serves it to a request alone or batched; None where
        this batch cannot make one. Only between cycles."""
        return None

    def _between_cycles(self, what: str) -> None:
        if self.book.block is not None:
            raise RuntimeError(f"{what} between cycles: crop the last verified block first")

    def leave(self, key: Hashable) -> None:
        """Drop sequence ``key`` and its cache rows. Only between cycles."""
        self.leave_many([key])

    def leave_many(self, keys: Sequence[Hashable]) -> None:
        """Drop the sequences ``keys`` and their cache rows at once (one copy of the caches, not
        one per sequence: a batch whose requests end together). Only between cycles."""
        self._between_cycles("leave")
        rows = sorted({self.keys.index(key) for key in keys})
        self.keys = [key for row, key in enumerate(self.keys) if row not in rows]
        if not self.keys:
            self._empty()
        elif rows:
            self._drop_rows(rows)

    @abstractmethod
    def _empty(self) -> None:
        """Start over with no sequence: empty caches and bookkeeping."""

    @abstractmethod
    def _drop_rows(self, rows: list[int]) -> None:
        """Drop rows ``rows``' caches and bookkeeping (``keys`` no longer has them; some rows remain)."""

    @abstractmethod
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture(),
               trees: Sequence["DraftTree | None"] | None = None) -> list[ForwardOutput]:
        """Run ``blocks[i]`` (anchor + drafts of ``keys[i]``, one token or more) after each
        sequence's cache, in one forward; per sequence, the logits and captured states of its rows.
        A sequence given ``trees[i]`` (its block: the tree's tokens, node order) runs it as a tree:
        node ``j`` at the sequence's length + its depth, seeing its ancestors only among the
        block's rows (where :meth:`tree_problem` is None)."""

    @abstractmethod
    def crop(self, lengths: Sequence[int], paths: Sequence[Sequence[int] | None] | None = None) -> None:
        """After :meth:`verify`: keep each sequence's first ``lengths[i]`` positions, between its
        length before the block and that plus the block's width (its own accepted length); a tree
        row keeps its accepted ``paths[i]`` (node indices, root first), as a chain over that path."""

    def tree_problem(self) -> str | None:
        """Why this batch's sequences cannot verify trees (they verify chains), or None."""
        if "linear_attention" in (self.target.info.layer_types or ()):
            return "a batch verifies chains on Gated DeltaNet targets (no recurrent state per tree node in a batch)"
        return self.target.tree_problem()

    def _checked_widths(self, blocks: Sequence[Sequence[int]], trees=None) -> list[int]:
        """Each block's width, after checking there is one block per sequence, each with its anchor
        (and, for a tree row, its tree's tokens)."""
        if len(blocks) != len(self.keys):
            raise ValueError(f"verify got {len(blocks)} blocks for a batch of {len(self.keys)} sequences")
        widths = [len(block) for block in blocks]
        if min(widths, default=0) < 1:
            raise ValueError(f"every sequence's block needs its anchor token; widths were {widths}")
        if trees is not None and any(tree is not None for tree in trees):
            if self.tree_problem() is not None:
                raise ValueError(f"this batch cannot verify trees: {self.tree_problem()}")
            for key, block, tree in zip(self.keys, blocks, trees):
                if tree is not None and list(block) != list(tree.tokens):
                    raise ValueError(f"sequence {key!r}: a tree row's block must be its tree's tokens")
        return widths
