"""What a backend offers to verify several live sequences in one target forward (docs/batching.md).

The batch scheduler of issue #39 will stand on this: each cycle it verifies every sequence's
anchor + drafts (ragged widths) in one :meth:`BatchedTarget.verify` and rolls each sequence back to
its own accepted length with one :meth:`BatchedTarget.crop`; sequences join and leave between
cycles. Arrays are the backend's, handled through its ``ArrayOps`` as everywhere in core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Sequence

import numpy as np

from speculant.core.batch_join import Join, JoinSteps, PendingJoin, Restored, check_prompt, join_plan
from speculant.core.prefix_cache import CacheSnapshot
from speculant.core.types import Capture, ForwardOutput, TargetInfo


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
        (:func:`join_plan`; those restoring stored prefixes together, each after its own): a burst of
        requests costs a few forwards, not one each. The keys go into :attr:`keys` group by group, so read the rows' order from there."""
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
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture()) -> list[ForwardOutput]:
        """Run ``blocks[i]`` (anchor + drafts of ``keys[i]``, one token or more) after each
        sequence's cache, in one forward; per sequence, the logits and captured states of its rows."""

    @abstractmethod
    def crop(self, lengths: Sequence[int]) -> None:
        """After :meth:`verify`: keep each sequence's first ``lengths[i]`` positions, between its
        length before the block and that plus the block's width (its own accepted length)."""

    def _checked_widths(self, blocks: Sequence[Sequence[int]]) -> list[int]:
        """Each block's width, after checking there is one block per sequence, each with its anchor."""
        if len(blocks) != len(self.keys):
            raise ValueError(f"verify got {len(blocks)} blocks for a batch of {len(self.keys)} sequences")
        widths = [len(block) for block in blocks]
        if min(widths, default=0) < 1:
            raise ValueError(f"every sequence's block needs its anchor token; widths were {widths}")
        return widths


class RowBook:
    """Which cache columns hold which positions of which row, on the host (numpy), for every
    backend's :class:`BatchedTarget` over one rectangular cache ``[rows, ..., columns, ...]``.

    ``valid[r, c]``: column ``c`` holds a position of row ``r``; ``positions[r, c]``: which one.
    A verify block appends ``widest`` columns to every row (the padding ones not valid); a crop
    clears the valid bits past each row's accepted length; :meth:`compaction` gives the gather
    that moves each row's held columns first, once that frees ``compact_at`` of the columns."""

    def __init__(self, compact_at: float = 0.25, lengths: Sequence[int] = ()) -> None:
        self.compact_at = compact_at
        self.valid = np.zeros((0, 0), dtype=bool)
        self.positions = np.zeros((0, 0), dtype=np.int64)
        self.block: tuple[np.ndarray, list[int]] | None = None  # (lengths before, widths) of the open block
        for length in lengths:  # rows holding that many positions each
            self.add_row(length)

    @property
    def columns(self) -> int:
        return int(self.valid.shape[1])

    @property
    def lengths(self) -> np.ndarray:
        return self.valid.sum(axis=1)

    def add_row(self, length: int) -> None:
        """A row holding positions ``0 .. length - 1`` in its first columns (the cache pads to :attr:`columns`)."""
        columns = max(self.columns, length)
        row = np.arange(columns) < length
        self.valid = np.concatenate([_pad(self.valid, columns), row[None]], axis=0)
        self.positions = np.concatenate([_pad(self.positions, columns), np.arange(columns)[None]], axis=0)

    def extend(self, other: "RowBook") -> None:
        """Append ``other``'s rows below these (both padded to the wider's columns, not valid)."""
        columns = max(self.columns, other.columns)
        self.valid = np.concatenate([_pad(self.valid, columns), _pad(other.valid, columns)], axis=0)
        self.positions = np.concatenate([_pad(self.positions, columns), _pad(other.positions, columns)], axis=0)

    def held(self, row: int) -> np.ndarray:
        """The columns holding row ``row``'s positions, in position order."""
        columns = np.flatnonzero(self.valid[row])
        return columns[np.argsort(self.positions[row, columns], kind="stable")]

    def drop_rows(self, rows: Sequence[int]) -> None:
        self.valid = np.delete(self.valid, rows, axis=0)
        self.positions = np.delete(self.positions, rows, axis=0)

    def wants_compaction(self) -> bool:
        """Whether compacting would drop ``compact_at`` of the columns (a compaction keeps as many
        columns as the longest row holds; the unused tail of a shorter row stays, so it does not count)."""
        return self.columns - int(self.lengths.max(initial=0)) > self.compact_at * self.columns

    def open_block(self, widths: Sequence[int]) -> np.ndarray:
        """Append a block of ``widths[r]`` positions to each row; the positions ``[rows, widest]``."""
        if self.block is not None:
            raise RuntimeError("crop the last verified block before the next")
        widest, lengths = max(widths), self.lengths
        query = lengths[:, None] + np.arange(widest)[None, :]
        self.valid = np.concatenate([self.valid, np.arange(widest)[None, :] < np.asarray(widths)[:, None]], axis=1)
        self.positions = np.concatenate([self.positions, query], axis=1)
        self.block = (lengths, list(widths))
        return query

    def visible(self, query: np.ndarray, window: int | None) -> np.ndarray:
        """``[rows, queries, columns]``: which columns each query of the last block reads (its
        row's held positions up to its own, within ``window`` positions back when one is given)."""
        return visible_columns(query, self.positions, self.valid, window)

    def crop(self, lengths: Sequence[int], names: Sequence) -> bool:
        """Keep row ``r``'s first ``lengths[r]`` positions; whether the cache should compact now
        (:meth:`wants_compaction`)."""
        before, widths = _closed_block(self.block, lengths, names)
        start = self.columns - max(widths)  # the block's first column
        for row, (length, first) in enumerate(zip(lengths, before.tolist())):
            self.valid[row, start + length - first:] = False
        self.block = None
        return self.wants_compaction()

    def compaction(self) -> np.ndarray:
        """Apply a compaction here and return its gather ``[rows, longest]`` of column indices,
        for the cache to apply to its keys and values."""
        counts = self.lengths
        longest = int(counts.max()) if counts.size else 0
        order = np.argsort(~self.valid, axis=1, kind="stable")[:, :longest]  # held columns first, in order
        self.positions = np.take_along_axis(self.positions, order, axis=1)
        self.valid = np.arange(longest)[None, :] < counts[:, None]
        return order


def visible_columns(query, positions, valid, window: int | None):
    """``[rows, queries, columns]``: whether query ``q`` of row ``r`` (at position ``query[r, q]``)
    reads column ``c`` (``valid[r, c]``, holding ``positions[r, c]``): its row's held positions up
    to its own, within ``window`` positions back when one is given. Any array library with numpy's
    broadcasting (the backends build it on their device from the book's arrays)."""
    distance = query[:, :, None] - positions[:, None, :]
    allowed = valid[:, None, :] & (distance >= 0)
    return allowed & (distance < window) if window is not None else allowed


class FlatBook:
    """The flattened layout's bookkeeping (vLLM's, without pages): every sequence's positions in
    the columns of ONE cache row, ``owner[c]`` the sequence column ``c`` belongs to. A verify
    block is every sequence's anchor + drafts end to end (``sum(widths)`` tokens, no padding), each
    token reading only its own sequence's held columns up to its position."""

    def __init__(self, compact_at: float = 0.25) -> None:
        self.compact_at = compact_at
        self.rows = 0
        self.owner = np.zeros(0, dtype=np.int64)
        self.positions = np.zeros(0, dtype=np.int64)
        self.valid = np.zeros(0, dtype=bool)
        self.block: tuple[np.ndarray, list[int]] | None = None

    @property
    def columns(self) -> int:
        return int(self.owner.size)

    @property
    def lengths(self) -> np.ndarray:
        return np.bincount(self.owner[self.valid], minlength=self.rows)

    def extend(self, book: RowBook) -> None:
        """Append ``book``'s rows (a joining sequence's own padded book), each row's columns end to end."""
        for row in range(book.valid.shape[0]):
            self._append(np.full(book.columns, self.rows), book.positions[row], book.valid[row])
            self.rows += 1

    def drop_rows(self, rows: Sequence[int]) -> None:
        gone = np.isin(self.owner, rows)
        self.valid[gone] = False
        shift = np.searchsorted(np.asarray(rows), self.owner)  # the dropped rows before each owner
        self.owner = np.where(gone, -1, self.owner - shift)
        self.rows -= len(rows)

    def wants_compaction(self) -> bool:
        """Whether compacting would drop ``compact_at`` of the columns."""
        return self.columns - int(self.valid.sum()) > self.compact_at * self.columns

    def open_block(self, widths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Append every row's block end to end; each token's position and owner ``[sum(widths)]``."""
        if self.block is not None:
            raise RuntimeError("crop the last verified block before the next")
        lengths = self.lengths
        owner = np.repeat(np.arange(self.rows), widths)
        query = np.concatenate([length + np.arange(width) for length, width in zip(lengths, widths)])
        self._append(owner, query, np.ones(query.size, dtype=bool))
        self.block = (lengths, list(widths))
        return query, owner

    def visible(self, query: np.ndarray, owner: np.ndarray, window: int | None) -> np.ndarray:
        """``[tokens, columns]``: which columns each token of the last block reads."""
        allowed = visible_columns(query[None], self.positions[None], self.valid[None], window)[0]
        return allowed & (self.owner[None, :] == owner[:, None])

    def crop(self, lengths: Sequence[int], names: Sequence) -> bool:
        """Keep row ``r``'s first ``lengths[r]`` positions; whether the cache should compact now
        (when that frees ``compact_at`` of the columns)."""
        before, widths = _closed_block(self.block, lengths, names)
        start = self.columns - sum(widths)
        for length, first, width in zip(lengths, before.tolist(), widths):
            self.valid[start + length - first:start + width] = False
            start += width
        self.block = None
        return self.wants_compaction()

    def compaction(self) -> np.ndarray:
        """Apply a compaction here and return the held columns' indices, in order (the gather)."""
        order = np.flatnonzero(self.valid)
        self.owner, self.positions, self.valid = self.owner[order], self.positions[order], self.valid[order]
        return order

    def _append(self, owner: np.ndarray, positions: np.ndarray, valid: np.ndarray) -> None:
        self.owner = np.concatenate([self.owner, owner])
        self.positions = np.concatenate([self.positions, positions])
        self.valid = np.concatenate([self.valid, valid])


def _closed_block(block, lengths: Sequence[int], names: Sequence) -> tuple[np.ndarray, list[int]]:
    """The open block's (lengths before, widths), after checking ``lengths`` keep within it."""
    if block is None:
        raise RuntimeError("crop rolls back the last verify block; no block was verified since the last crop")
    before, widths = block
    if len(lengths) != len(widths):
        raise ValueError(f"crop got {len(lengths)} lengths for a batch of {len(widths)} sequences")
    for row, (length, first, width) in enumerate(zip(lengths, before.tolist(), widths)):
        if not first <= length <= first + width:
            raise ValueError(f"sequence {names[row]!r}: crop to {length} outside its last block "
                             f"({first} .. {first + width} positions)")
    return before, widths


def _pad(book: np.ndarray, columns: int) -> np.ndarray:
    return np.pad(book, ((0, 0), (0, columns - book.shape[1])))
