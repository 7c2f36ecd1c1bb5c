"""Several live sequences verified in one forward of an MLX target (issue #39, docs/batching.md).

The same design as the PyTorch batch (``backends/torch/batch.py``) over the same bookkeeping
(``core.batch_book.RowBook``): one rectangular cache per attention layer, ``[rows, heads, columns,
dim]``; a verify block right-padded to the widest row. mlx-lm's attention reads neither positions
nor a mask from its caller: it rotates at ``cache.offset`` and asks the cache for its mask. So each
layer's :class:`RowsCache` answers with an ``offset`` array (each row's first block position;
``mx.fast.rope`` takes one offset per row) and with the row book's mask. A sequence joins through
the same forward over a one-row cache of its own (in chunks of ``PREFILL_STEP`` rows, as the
single-sequence prefill; after a stored prefix-cache snapshot's rows where there is one,
``batch_rows.py``), then becomes a row. Full and sliding-window
attention (sliding rows kept at full length, masked to the window). Gated DeltaNet layers keep
the single-sequence ``caches.DeltaCache``, one row per sequence: a verify runs inside
``caches.recording`` (each position's recurrent state of every row, and the block's convolution
inputs) and the crop gives each row the states after its own accepted count
(``DeltaCache.keep_rows``). A row's padding follows its real tokens, so it only moves states the
crop throws away; the linear layers get no mask.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Hashable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache

from speculant.backends.mlx import batch_rows as rows
from speculant.backends.mlx.caches import DeltaCache, WindowKVCache, recording, target_cache
from speculant.backends.mlx.target import PREFILL_STEP, _join
from speculant.backends.mlx.tree import rows_positions
from speculant.core import spare_room
from speculant.core.batch import BatchedTarget, Restored
from speculant.core.batch_book import RowBook, visible_columns
from speculant.core.batch_join import JoinSteps, prefill_blocks, run_steps
from speculant.core.prefix_cache import CacheSnapshot
from speculant.core.types import Capture, ForwardOutput


class RowsCache(_BaseCache):
    """One attention layer's keys and values of every row; ``offset`` and the mask are the
    current forward's, set by :class:`MLXBatch` before it runs."""

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.keys = self.values = None
        self.offset: mx.array | int = 0
        self.mask: mx.array | None = None

    keys = spare_room.HeldColumns()  # [rows, heads, held columns, dim] of spare-room buffers
    values = spare_room.HeldColumns()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        spare_room.append(self, keys, values, lambda like, shape: mx.zeros(shape, like.dtype))
        return self.keys, self.values

    def make_mask(self, N: int, *args, **kwargs) -> mx.array | None:
        return self.mask

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def gather(self, index: mx.array, axis: int) -> None:
        """Keep the rows (``axis`` 0, ``index`` [rows]) or each row's columns (``axis`` 2,
        ``index`` [rows, columns])."""
        if self.keys is None:
            return
        if axis == 0:
            self.keys, self.values = mx.take(self.keys, index, axis=0), mx.take(self.values, index, axis=0)
            return
        shape = (*self.keys.shape[:2], index.shape[1], self.keys.shape[3])
        where = mx.broadcast_to(index[:, None, :, None], shape)
        self.keys = mx.take_along_axis(self.keys, where, axis=2)
        self.values = mx.take_along_axis(self.values, where, axis=2)

    def append_rows(self, other: "RowsCache", columns: int) -> None:
        """Add ``other``'s rows below these, both padded to ``columns``."""
        if self.keys is None:
            self.keys, self.values = _pad(other.keys, columns), _pad(other.values, columns)
            return
        self.keys = mx.concatenate([_pad(self.keys, columns), _pad(other.keys, columns)], axis=0)
        self.values = mx.concatenate([_pad(self.values, columns), _pad(other.values, columns)], axis=0)


class MLXBatch(BatchedTarget):
    """The live sequences of one batch over ``target`` (an ``MLXTarget``), row ``i`` being ``keys[i]``."""

    def __init__(self, target) -> None:
        super().__init__(target)
        self._kinds = target_cache(target.model, target.info.sliding_window)  # what each layer's cache is
        self._empty()

    def _empty(self) -> None:
        self.layers = self._new_layers()
        self.book = RowBook(self.compact_at)

    def _new_layers(self) -> list[RowsCache | DeltaCache]:
        return [DeltaCache(len(c.cache)) if isinstance(c, DeltaCache)
                else RowsCache(c.window if isinstance(c, WindowKVCache) else None) for c in self._kinds]

    join_tokens = PREFILL_STEP

    def _join_row(self, token_ids: Sequence[int], capture: Capture, restored: Restored | None) -> ForwardOutput:
        return run_steps(self._join_steps(token_ids, capture, restored))

    def _join_steps(self, token_ids: Sequence[int], capture: Capture, restored: Restored | None) -> JoinSteps:
        if restored is None:
            outs = yield from self._prefill_steps([token_ids], self._new_layers(), RowBook(lengths=[0]), capture)
        else:  # the stored positions as a row of their own, then the rest run after them
            start = restored[1]
            solo, book = rows.restored(self, *restored), RowBook(lengths=[start])
            outs = yield from self._prefill_steps([token_ids[start:]], solo, book, capture)
        return outs[0]

    def _join_rows(self, prompts: list[Sequence[int]], capture: Capture,
                   restored: list[Restored] | None = None) -> list[ForwardOutput]:
        if restored is None:
            return run_steps(self._prefill_steps(prompts, self._new_layers(), RowBook(lengths=[0] * len(prompts)),
                                                 capture))
        group = self._stored_rows(restored)  # the stored rows, then the rest run after them
        rests = [prompt[length:] for prompt, (_, length) in zip(prompts, restored)]
        return run_steps(self._prefill_steps(rests, group.layers, group.book, capture))

    def _prefill_steps(self, prompts: list[Sequence[int]], solo: list, book: RowBook, capture: Capture):
        """Run ``prompts`` after ``solo``'s rows (``book``'s), as the single prefill does (the
        chunks' logits are never evaluated, the last tokens' are), yielding after each chunk; then
        add the rows to the batch and return their outputs."""
        features, finals = [[] for _ in prompts], [[] for _ in prompts]
        for step, chunk in enumerate(prefill_blocks(prompts, self.join_tokens // len(prompts))):
            if step:
                yield  # between chunks the batch may verify its rows
            logits, f, h = self._forward(chunk, solo, book, capture)
            for row, block in enumerate(chunk):
                features[row].append(_row(f, row, len(block)))
                finals[row].append(_row(h, row, len(block)))
            mx.eval(_arrays(solo) + [a for a in (f, h) if a is not None])
        self._add(solo, book)
        self._settle(logits)
        return [ForwardOutput(logits=logits[row], features=_join(f), final_hidden=_join(h))
                for row, (f, h) in enumerate(zip(features, finals))]

    def _add(self, solo: list, book: RowBook) -> None:
        """Add the rows of ``solo`` (``book``'s) below the batch's."""
        self.book.extend(book)
        for layer, new in zip(_attention(self.layers), _attention(solo)):
            layer.append_rows(new, self.book.columns)
        for layer, new in zip(_deltas(self.layers), _deltas(solo)):
            if layer.empty():
                layer.cache = list(new.cache)
            else:
                layer.extend(new)

    def _add_snapshot(self, snapshot: CacheSnapshot, length: int) -> None:
        self._add(rows.restored(self, snapshot, length), RowBook(lengths=[length]))
        mx.eval(_arrays(self.layers))

    def can_restore(self, snapshot: CacheSnapshot) -> bool:
        return rows.restorable(snapshot)

    def snapshot(self, key: Hashable) -> CacheSnapshot | None:
        return rows.snapshot(self, self.keys.index(key))

    def _drop_rows(self, rows: list[int]) -> None:
        kept = mx.array([i for i in range(len(self.keys) + len(rows)) if i not in rows])
        for layer in _attention(self.layers):
            layer.gather(kept, axis=0)
        for layer in _deltas(self.layers):
            layer.filter(kept)
        self.book.drop_rows(rows)
        if self.book.wants_compaction():  # the trailing columns only the rows that left used
            self._compact()

    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture(), trees=None) -> list[ForwardOutput]:
        self._between_cycles("verify")
        widths = self._checked_widths(blocks, trees)
        logits, features, final = self._forward(blocks, self.layers, self.book, capture, trees)
        self._settle(logits)
        return [ForwardOutput(logits=logits[row, :width], features=_row(features, row, width),
                              final_hidden=_row(final, row, width))
                for row, width in enumerate(widths)]

    def crop(self, lengths: Sequence[int], paths=None) -> None:
        before = self.lengths_before_block()
        if self.book.crop(lengths, self.keys, paths):
            self._compact()
        for layer in _deltas(self.layers):
            layer.keep_rows([length - first for length, first in zip(lengths, before)])

    def _forward(self, blocks: Sequence[Sequence[int]], layers: list[RowsCache], book: RowBook, capture: Capture,
                 trees=None):
        """One forward of ``blocks`` (right-padded with 0, masked) after ``layers``' rows; rows
        given ``trees`` at their nodes' positions, seeing their ancestors only among the block's."""
        widest = max(len(block) for block in blocks)
        ids = np.zeros((len(blocks), widest), dtype=np.int32)
        for row, block in enumerate(blocks):
            ids[row, : len(block)] = block
        query = book.open_block([len(block) for block in blocks], trees)
        attention = _attention(layers)
        # built on the device from the book's arrays, not on the host
        query_d, positions, valid = mx.array(query), mx.array(book.positions), mx.array(book.valid)
        branches = book.block_visibility()  # tree rows see only their ancestors among the block's columns
        shown = None if branches is None else mx.array(branches)
        masks = {window: _visible(visible_columns(query_d, positions, valid, window), shown)[:, None]
                 for window in {a.window for a in attention}}
        for layer in attention:
            layer.offset, layer.mask = mx.array(query[:, 0]), masks[layer.window]
        recorder = self.target._recorder
        recorder.start(capture)
        try:
            # a verify records each position's Gated DeltaNet states (caches.py), a join's prefill none
            with recording(layers) if book is self.book else nullcontext(), \
                    rows_positions(self.target.attentions(), query_d) if branches is not None else nullcontext():
                logits = self.target.model(mx.array(ids), cache=layers)
        except BaseException:
            recorder.start(Capture())  # stop recording; keep the original error
            raise
        features, final = recorder.finish(capture, batched=True)
        if book is not self.book:  # a joining sequence's own forward: its book is done with
            book.block = None
        return logits, features, final

    def _settle(self, logits: mx.array) -> None:
        """Evaluate the forward and the caches now, so the graph does not grow across cycles."""
        mx.eval([logits] + _arrays(self.layers))

    def _compact(self) -> None:
        order = mx.array(self.book.compaction())
        for layer in _attention(self.layers):
            layer.gather(order, axis=2)


def _visible(allowed: mx.array, branches: mx.array | None) -> mx.array:
    return allowed if branches is None else allowed & branches


def _attention(layers: list) -> list[RowsCache]:
    return [layer for layer in layers if isinstance(layer, RowsCache)]


def _deltas(layers: list) -> list[DeltaCache]:
    return [layer for layer in layers if isinstance(layer, DeltaCache)]


def _arrays(layers: list) -> list[mx.array]:
    """What the layers hold (a DeltaCache's recorded block included), to evaluate."""
    held = []
    for layer in layers:
        if isinstance(layer, DeltaCache):
            held += [a for a in (*layer.cache, layer.conv_input, *layer.states) if a is not None]
        else:
            held += layer.state
    return held


def _pad(array: mx.array, columns: int) -> mx.array:
    missing = columns - int(array.shape[2])
    return array if missing == 0 else mx.pad(array, [(0, 0), (0, 0), (0, missing), (0, 0)])


def _row(states: mx.array | None, row: int, width: int | None = None) -> mx.array | None:
    if states is None:
        return None
    return states[row] if width is None else states[row, :width]
