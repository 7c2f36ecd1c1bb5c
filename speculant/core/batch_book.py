"""The host-side bookkeeping of a batch's caches (core/batch.py): which cache columns hold which
positions of which sequence, in the padded layout (:class:`RowBook`, one row per sequence) and the
flattened one (:class:`FlatBook`, every sequence in one row), and the visibility built from it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from speculant.core.tree import DraftTree


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
        self.ancestors: np.ndarray | None = None  # [rows, widest, widest] of the open block, where it holds trees
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

    def open_block(self, widths: Sequence[int], trees: Sequence["DraftTree | None"] | None = None) -> np.ndarray:
        """Append a block of ``widths[r]`` positions to each row; the positions ``[rows, widest]``.
        A row given a tree (``trees[r]``, its ``size`` the row's width) holds its node ``i`` at the
        row's length + the node's depth, and sees among the block's columns only its ancestors
        (:meth:`block_visibility`)."""
        if self.block is not None:
            raise RuntimeError("crop the last verified block before the next")
        widest, lengths = max(widths), self.lengths
        offsets = np.broadcast_to(np.arange(widest), (len(widths), widest)).copy()
        self.ancestors = None
        if trees is not None and any(tree is not None for tree in trees):
            self.ancestors = np.broadcast_to(np.tri(widest, dtype=bool), (len(widths), widest, widest)).copy()
            for row, tree in enumerate(trees):
                if tree is not None:
                    offsets[row, :tree.size] = tree.depths
                    self.ancestors[row, :tree.size, :tree.size] = tree.ancestor_mask()
        query = lengths[:, None] + offsets
        self.valid = np.concatenate([self.valid, np.arange(widest)[None, :] < np.asarray(widths)[:, None]], axis=1)
        self.positions = np.concatenate([self.positions, query], axis=1)
        self.block = (lengths, list(widths))
        return query

    def block_visibility(self) -> np.ndarray | None:
        """``[rows, widest, columns]``: False where a block row's query must not read a column of
        the block that comes before it by position but is no ancestor of it (its tree's other
        branches); None when no row of the open block is a tree."""
        if self.ancestors is None:
            return None
        rows, widest = self.ancestors.shape[:2]
        before = np.ones((rows, widest, self.columns - widest), dtype=bool)
        return np.concatenate([before, self.ancestors], axis=2)

    def visible(self, query: np.ndarray, window: int | None) -> np.ndarray:
        """``[rows, queries, columns]``: which columns each query of the last block reads (its
        row's held positions up to its own, within ``window`` positions back when one is given)."""
        return visible_columns(query, self.positions, self.valid, window)

    def crop(self, lengths: Sequence[int], names: Sequence,
             kept: Sequence[Sequence[int] | None] | None = None) -> bool:
        """Keep row ``r``'s first ``lengths[r]`` positions: its block's first columns, or, where
        ``kept[r]`` names them, those block columns (a tree's accepted path, in order, as many as
        the row keeps); whether the cache should compact now (:meth:`wants_compaction`)."""
        before, widths = _closed_block(self.block, lengths, names)
        kept = [None] * len(lengths) if kept is None else kept
        for row, (length, first, columns) in enumerate(zip(lengths, before.tolist(), kept)):
            if columns is not None and len(columns) != length - first:
                raise ValueError(f"sequence {names[row]!r} keeps {len(columns)} tree nodes for {length - first} positions")
        start = self.columns - max(widths)  # the block's first column
        for row, (length, first, columns) in enumerate(zip(lengths, before.tolist(), kept)):
            if columns is None:
                self.valid[row, start + length - first:] = False
                continue
            self.valid[row, start:] = False
            self.valid[row, start + np.asarray(columns, dtype=np.int64)] = True
        self.block, self.ancestors = None, None
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
