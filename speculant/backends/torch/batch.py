"""Several live sequences verified in one forward of a PyTorch target (issue #39, docs/batching.md).

A :class:`TorchBatch` holds the rows of its sequences in one cache of its own, beside the
target's single-sequence cache. Each sequence joins with its prompt, prefilled alone (after the
rows of a stored prefix-cache snapshot where there is one, ``batch_rows.py``) and merged in as a
new row, and between cycles leaves; each cycle :meth:`TorchBatch.verify` runs every
sequence's anchor + drafts (ragged widths) in one forward and :meth:`TorchBatch.crop` rolls each
sequence back to its own accepted length.

Layout: one rectangular cache ``[batch, heads, columns, dim]`` with, per row, which columns hold
its positions and the position each column holds (``core.batch_book.RowBook``, the bookkeeping shared
with MLX: the masks, the crop's checks, the compaction's gather); a verify block is
right-padded to the widest sequence's width, with per-row position ids and a 4-D additive mask.
Chosen over flattened tokens (one ragged row with per-token positions, vLLM's layout) because
transformers' eager and SDPA attention take a batch dimension and a ready 4-D mask as they are,
on every device, while a flattened batch needs a variable-length attention kernel
(flash-attention's ``cu_seqlens``) that CPUs and MPS lack. A rollback is then clearing a row's
mask bits, no copy; the holes it leaves are squeezed out (:meth:`TorchBatch._compact`, one gather)
once they pass ``compact_at`` of the cache. The padding costs ``sum(widest - width)`` wasted query
rows a cycle, small beside the cache the queries read.

Layer kinds: full attention, and sliding-window attention as full-length rows masked to the
window (a column is visible when ``query position - its position < window``), so sliding layers
keep every row while batched (memory, not correctness; a trim of columns every row has left
behind is future work). Gated DeltaNet (``linear_attention``): per row, a recurrent state and a
short-convolution window. The batch's cache is a ``rollback.RollbackCache`` (its attention layers
plain full-length ones): a verify records each position's recurrent state of every row (the
single-sequence rollback's delta-rule wrapper, over ``[rows, ...]``) and keeps the block's
convolution inputs; the crop gives each row the state after its own accepted count and the
``kernel`` inputs before it (:func:`_keep_linear`). A row's padding comes after its real tokens, so
it only moves states the crop throws away; the linear layers get no mask.
MLX: ``backends/mlx/batch.py``, over the same ``RowBook``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Hashable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from speculant.backends.torch import batch_rows as rows
from speculant.backends.torch.growing import GrowingLayer
from speculant.backends.torch.rollback import RollbackCache
from speculant.core.batch import BatchedTarget, Restored
from speculant.core.batch_book import RowBook, visible_columns
from speculant.core.batch_join import JoinSteps, prefill_blocks, run_steps
from speculant.core.prefix_cache import CacheSnapshot
from speculant.core.types import Capture, ForwardOutput

LINEAR = "linear_attention"


class TorchBatch(BatchedTarget):
    """The live sequences of one batch over ``target`` (a ``TorchTarget``), row ``i`` being ``keys[i]``."""

    def __init__(self, target) -> None:
        super().__init__(target)
        self._device = target.model.device
        kinds = tuple(dict.fromkeys(target.info.layer_types or ("full_attention",)))
        self._hybrid = LINEAR in kinds
        self._windows = {kind: target.info.sliding_window if kind == "sliding_attention" else None
                         for kind in kinds if kind != LINEAR}
        self._empty()

    def _empty(self) -> None:
        self.cache = self._new_cache()
        self.book = RowBook(self.compact_at)

    def _new_cache(self) -> DynamicCache:
        """Every attention layer a full-length ``GrowingLayer`` (sliding ones are masked); Gated
        DeltaNet layers recording their last forward (``RollbackCache``) until :func:`_keep_linear`."""
        if not self._hybrid:
            cache = DynamicCache()
            cache.layer_class_to_replicate = GrowingLayer
            return cache
        cache = RollbackCache(self.target.model.config)
        cache.layers = [layer if isinstance(layer, LinearAttentionCacheLayerMixin) else GrowingLayer()
                        for layer in cache.layers]
        return cache

    join_tokens = 512

    @torch.inference_mode()
    def _join_row(self, token_ids: Sequence[int], capture: Capture, restored: Restored | None) -> ForwardOutput:
        """One forward (its logits_to_keep=1 spares the head the other rows)."""
        solo, book = self._solo(restored)
        start = 0 if restored is None else restored[1]
        logits, features, final = self._run_blocks([token_ids[start:]], solo, book, capture)
        _keep_linear(solo, [len(token_ids) - start], len(token_ids) - start)
        self._merge(solo, book)
        return ForwardOutput(logits=logits[0], features=_row(features, 0), final_hidden=_row(final, 0))

    def _join_steps(self, token_ids: Sequence[int], capture: Capture, restored: Restored | None) -> JoinSteps:
        start = 0 if restored is None else restored[1]
        with torch.inference_mode():  # (a generator's steps cannot run under one decorator)
            solo, book = self._solo(restored)
        outs = yield from self._prefill_steps([token_ids[start:]], solo, book, capture)
        return outs[0]

    def _join_rows(self, prompts: list[Sequence[int]], capture: Capture,
                   restored: list[Restored] | None = None) -> list[ForwardOutput]:
        if restored is None:
            return run_steps(self._prefill_steps(prompts, self._new_cache(), RowBook(lengths=[0] * len(prompts)),
                                                 capture))
        group = self._stored_rows(restored)  # the stored rows, then the rest run after them
        rests = [prompt[length:] for prompt, (_, length) in zip(prompts, restored)]
        return run_steps(self._prefill_steps(rests, group.cache, group.book, capture))

    def _solo(self, restored: Restored | None) -> tuple:
        """A joining row's own cache and book: empty, or the stored positions (then the rest run after them)."""
        if restored is None:
            return self._new_cache(), RowBook(lengths=[0])
        return rows.restored(self, *restored), RowBook(lengths=[restored[1]])

    def _prefill_steps(self, prompts: list[Sequence[int]], solo, book: RowBook, capture: Capture):
        """The chunks (every prompt but its last token, right-padded) with one logit row each,
        then the last tokens, whose logits are each row's; yields after each but the last, then
        adds the rows and returns their outputs."""
        features, finals = [[] for _ in prompts], [[] for _ in prompts]
        for step, blocks in enumerate(prefill_blocks(prompts, self.join_tokens // len(prompts))):
            if step:
                yield  # between chunks the batch may verify its rows
            widths = [len(block) for block in blocks]
            with torch.inference_mode():
                logits, f, h = self._run_blocks(blocks, solo, book, capture)
                _keep_linear(solo, widths, max(widths))  # (a hybrid's group has one length: no padding)
            for row, width in enumerate(widths):
                features[row].append(_row(f, row, width))
                finals[row].append(_row(h, row, width))
        with torch.inference_mode():
            self._merge(solo, book)
        return [ForwardOutput(logits=logits[row], features=_cat(f), final_hidden=_cat(h))
                for row, (f, h) in enumerate(zip(features, finals))]

    def can_restore(self, snapshot: CacheSnapshot) -> bool:
        return rows.restorable(snapshot)

    @torch.inference_mode()
    def _add_snapshot(self, snapshot: CacheSnapshot, length: int) -> None:
        self._merge(rows.restored(self, snapshot, length), RowBook(lengths=[length]))

    @torch.inference_mode()
    def snapshot(self, key: Hashable) -> CacheSnapshot | None:
        return rows.snapshot(self, self.keys.index(key))

    @torch.inference_mode()
    def _drop_rows(self, rows: list[int]) -> None:
        kept = torch.tensor([i for i in range(len(self.keys) + len(rows)) if i not in rows], device=self._device)
        for layer in _attention_layers(self.cache):
            layer.keys, layer.values = layer.keys.index_select(0, kept), layer.values.index_select(0, kept)
        for layer in _linear_layers(self.cache):
            layer.conv_states[0] = layer.conv_states[0].index_select(0, kept)
            layer.recurrent_states[0] = layer.recurrent_states[0].index_select(0, kept)
        self.book.drop_rows(rows)
        if self.book.wants_compaction():  # the trailing columns only the rows that left used
            self._compact()

    @torch.inference_mode()
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture(), trees=None) -> list[ForwardOutput]:
        self._between_cycles("verify")
        widths = self._checked_widths(blocks, trees)
        logits, features, final = self._run_blocks(blocks, self.cache, self.book, capture, logits_to_keep=0,
                                                   trees=trees)
        return [ForwardOutput(logits=logits[row, :width], features=_row(features, row, width),
                              final_hidden=_row(final, row, width))
                for row, width in enumerate(widths)]

    @torch.inference_mode()
    def crop(self, lengths: Sequence[int], paths=None) -> None:
        before = self.lengths_before_block()
        widest = max(self.book.block[1])
        if self.book.crop(lengths, self.keys, paths):
            self._compact()
        if self._hybrid:
            _keep_linear(self.cache, [length - first for length, first in zip(lengths, before)], widest)
            self.cache.block_states.clear()

    def _run_blocks(self, blocks: Sequence[Sequence[int]], cache, book: RowBook, capture: Capture,
                    logits_to_keep: int = 1, trees=None):
        """One forward of ``blocks`` (right-padded with 0, masked) after ``cache``'s rows (``book``'s);
        a joining group's own book is done with after it."""
        widths = [len(block) for block in blocks]
        ids = torch.zeros((len(blocks), max(widths)), dtype=torch.long, device=self._device)  # 0: padding, masked
        for row, block in enumerate(blocks):
            ids[row, : len(block)] = torch.as_tensor(list(block), device=self._device)
        query = book.open_block(widths, trees)
        out = self._forward(ids, cache, capture, logits_to_keep, attention_mask=self._mask(query, book),
                            position_ids=torch.from_numpy(query).to(self._device))
        if book is not self.book:
            book.block = None
        return out

    def _forward(self, ids: torch.Tensor, cache, capture: Capture, logits_to_keep: int, **inputs):
        target = self.target
        target._recorder.start(capture)
        try:
            # a verify records each position's Gated DeltaNet states (rollback.py), a join's prefill none
            with cache.verifying() if self._hybrid and cache is self.cache else nullcontext():
                out = target.model(input_ids=ids, **{target._cache_kwarg: cache}, use_cache=True,
                                   logits_to_keep=logits_to_keep, **inputs)
        except BaseException:  # stop recording, keep the original error
            target._recorder.finish(Capture())
            raise
        features, final = target._recorder.finish(capture, batched=True)
        return out.logits, features, final

    def _mask(self, query, book: RowBook | None = None):
        """The additive mask ``[rows, 1, widest, columns]`` per attention kind (the block's
        columns included) of ``book`` (the batch's): built on the device from the book's
        positions and validity, not on the host; one tensor for one kind, else a dict by
        ``layer_types`` name."""
        book = book or self.book
        query, positions, valid = (torch.from_numpy(a).to(self._device) for a in (query, book.positions, book.valid))
        trees = book.block_visibility()  # tree rows see only their ancestors among the block's columns
        if trees is None:
            return self._masks(lambda window: visible_columns(query, positions, valid, window))
        trees = torch.from_numpy(trees).to(self._device)
        return self._masks(lambda window: visible_columns(query, positions, valid, window) & trees)

    def _masks(self, visible):
        """The masks from ``visible(window)``: its booleans ``[rows, widest, columns]`` on the device."""
        dtype = self.target.model.dtype
        zero, blocked = torch.zeros((), dtype=dtype, device=self._device), torch.finfo(dtype).min
        masks = {kind: torch.where(visible(window), zero, blocked)[:, None]
                 for kind, window in self._windows.items()}
        if self._hybrid:
            masks[LINEAR] = None  # padding follows each row's tokens: it moves only states the crop drops
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _merge(self, solo, book: RowBook) -> None:
        """Add the prefilled cache ``solo`` (``book``'s rows) as the last sequences."""
        first = not self.keys
        self.book.extend(book)
        if first:
            self.cache = solo
        else:
            self._append(solo)

    def _append(self, solo) -> None:
        """Add ``solo``'s rows below the others, padding the shorter side's columns."""
        columns = self.book.columns
        for layer, new in zip(_attention_layers(self.cache), _attention_layers(solo)):
            layer.keys = torch.cat([_pad(layer.keys, columns, 2), _pad(new.keys, columns, 2)], dim=0)
            layer.values = torch.cat([_pad(layer.values, columns, 2), _pad(new.values, columns, 2)], dim=0)
        for layer, new in zip(_linear_layers(self.cache), _linear_layers(solo)):
            layer.conv_states[0] = torch.cat([layer.conv_states[0], new.conv_states[0]])
            layer.recurrent_states[0] = torch.cat([layer.recurrent_states[0], new.recurrent_states[0]])

    def _compact(self) -> None:
        order = torch.from_numpy(self.book.compaction()).to(self._device)
        for layer in _attention_layers(self.cache):
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)


def _cat(parts: list) -> torch.Tensor | None:
    return None if parts[0] is None else torch.cat(parts) if len(parts) > 1 else parts[0]


def _attention_layers(cache) -> list:
    """The attention layers holding rows."""
    return [layer for layer in cache.layers
            if not isinstance(layer, LinearAttentionCacheLayerMixin) and layer.is_initialized]


def _linear_layers(cache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _keep_linear(cache, kept: Sequence[int], width: int) -> None:
    """Give each row ``r`` of every Gated DeltaNet layer its states after the first ``kept[r]``
    positions of the last forward (``width`` wide, its rows right-padded): the recurrent state
    recorded there and the last ``kernel`` convolution inputs up to there (zeros before the
    sequence's start). The layer recorded the forward (``RollbackCache``, past recording on): its
    conv state is the previous window + the forward's inputs, its history the state before each
    position, its state the one after the last."""
    for index, layer in enumerate(_linear_layers(cache)):
        device, size = layer.conv_states[0].device, layer.conv_kernel_size[0]
        at = torch.as_tensor(list(kept), device=device)
        inputs = torch.nn.functional.pad(layer.conv_states[0], (size, 0))  # [rows, channels, size + old + width]
        window = inputs.shape[-1] - size - width + at[:, None] + torch.arange(size, device=device)  # [rows, size]
        layer.conv_states[0] = inputs.gather(2, window[:, None, :].expand(-1, inputs.shape[1], -1))
        history = layer.recurrent_states_history[0]
        if any(k != width for k in kept):  # a prefill keeps everything: its state is the last one
            if len(history) != width:
                raise RuntimeError(f"Gated DeltaNet layer {index} of the batch recorded {len(history)} states for a "
                                   f"block of {width}: its delta rule is not one speculant records per position")
            states = torch.stack(history + [layer.recurrent_states[0]])  # [width + 1, rows, heads, k, v]
            layer.recurrent_states[0] = states[at, torch.arange(len(kept), device=device)]
        layer.recurrent_states_history[0] = []


def _pad(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros appended along ``dim`` up to ``size``."""
    missing = size - int(tensor.shape[dim])
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def _row(states: torch.Tensor | None, row: int, width: int | None = None) -> torch.Tensor | None:
    if states is None:
        return None
    return states[row] if width is None else states[row, :width]
