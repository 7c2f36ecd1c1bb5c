"""Several live sequences verified in one forward of a PyTorch target (issue #39, docs/batching.md).

A :class:`TorchBatch` holds the rows of its sequences in one cache of its own, beside the
target's single-sequence cache. Each sequence joins with its prompt (prefilled alone, then merged
in as a new row), and between cycles leaves; each cycle :meth:`TorchBatch.verify` runs every
sequence's anchor + drafts (ragged widths) in one forward and :meth:`TorchBatch.crop` rolls each
sequence back to its own accepted length.

Layout: one rectangular cache ``[batch, heads, columns, dim]`` with, per row, which columns hold
its positions and the position each column holds (``core.batch.RowBook``, the bookkeeping shared
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
behind is future work). Gated DeltaNet (``linear_attention``) is refused (``core.batch.batch_problem``):
its per-row recurrent and convolution states need per-position recording per row, not done yet.
MLX: ``backends/mlx/batch.py``, over the same ``RowBook``.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from transformers import DynamicCache

from speculant.core.batch import BatchedTarget, RowBook
from speculant.core.types import Capture, ForwardOutput


class TorchBatch(BatchedTarget):
    """The live sequences of one batch over ``target`` (a ``TorchTarget``), row ``i`` being ``keys[i]``."""

    def __init__(self, target) -> None:
        super().__init__(target)
        self._device = target.model.device
        kinds = tuple(dict.fromkeys(target.info.layer_types or ("full_attention",)))
        self._windows = {kind: target.info.sliding_window if kind == "sliding_attention" else None for kind in kinds}
        self._empty()

    def _empty(self) -> None:
        self.cache = DynamicCache()  # every layer a full-length DynamicLayer; sliding ones are masked
        self.book = RowBook(self.compact_at)

    @property
    def lengths(self) -> list[int]:
        return self.book.lengths.tolist()

    def lengths_before_block(self) -> list[int]:
        if self.book.block is None:
            raise RuntimeError("no block was verified since the last crop")
        return self.book.block[0].tolist()

    @torch.inference_mode()
    def join(self, key: Hashable, token_ids: Sequence[int], capture: Capture = Capture()) -> ForwardOutput:
        if key in self.keys:
            raise ValueError(f"sequence {key!r} is already in the batch")
        self._between_cycles("join")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {key!r} has an empty prompt; give it at least one token")
        solo = DynamicCache()
        ids = self.target.backend.int_array(token_ids)[None, :]
        logits, features, final = self._forward(ids, solo, capture, logits_to_keep=1)
        self._merge(solo, len(token_ids))
        self.keys.append(key)
        return ForwardOutput(logits=logits[0], features=_row(features, 0), final_hidden=_row(final, 0))

    @torch.inference_mode()
    def leave(self, key: Hashable) -> None:
        self._between_cycles("leave")
        row = self.keys.index(key)
        del self.keys[row]
        if not self.keys:
            self._empty()
            return
        kept = torch.tensor([i for i in range(len(self.keys) + 1) if i != row], device=self._device)
        for layer in self._layers():
            layer.keys, layer.values = layer.keys.index_select(0, kept), layer.values.index_select(0, kept)
        self.book.drop_row(row)
        self._compact()  # the trailing columns only the row that left used

    @torch.inference_mode()
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture()) -> list[ForwardOutput]:
        self._between_cycles("verify")
        if len(blocks) != len(self.keys):
            raise ValueError(f"verify got {len(blocks)} blocks for a batch of {len(self.keys)} sequences")
        widths = [len(block) for block in blocks]
        if min(widths, default=0) < 1:
            raise ValueError(f"every sequence's block needs its anchor token; widths were {widths}")
        ids = torch.zeros((len(blocks), max(widths)), dtype=torch.long, device=self._device)  # 0: padding, masked
        for row, block in enumerate(blocks):
            ids[row, : len(block)] = torch.as_tensor(list(block), device=self._device)
        query = self.book.open_block(widths)
        mask = self._mask(query)
        logits, features, final = self._forward(ids, self.cache, capture, logits_to_keep=0, attention_mask=mask,
                                                position_ids=torch.from_numpy(query).to(self._device))
        return [ForwardOutput(logits=logits[row, :width], features=_row(features, row, width),
                              final_hidden=_row(final, row, width))
                for row, width in enumerate(widths)]

    @torch.inference_mode()
    def crop(self, lengths: Sequence[int]) -> None:
        if self.book.crop(lengths, self.keys):
            self._compact()

    def _between_cycles(self, what: str) -> None:
        if self.book.block is not None:
            raise RuntimeError(f"{what} between cycles: crop the last verified block first")

    def _layers(self):
        return [layer for layer in self.cache.layers if layer.is_initialized]

    def _forward(self, ids: torch.Tensor, cache, capture: Capture, logits_to_keep: int, **inputs):
        target = self.target
        target._recorder.start(capture)
        try:
            out = target.model(input_ids=ids, **{target._cache_kwarg: cache}, use_cache=True,
                               logits_to_keep=logits_to_keep, **inputs)
        except BaseException:  # stop recording, keep the original error
            target._recorder.finish(Capture())
            raise
        features, final = target._recorder.finish(capture, batched=True)
        return out.logits, features, final

    def _mask(self, query):
        """The additive mask ``[rows, 1, widest, columns]`` per attention kind (the block's
        columns included); one tensor for one kind, else a dict by ``layer_types`` name."""
        dtype = self.target.model.dtype
        zero, blocked = torch.zeros((), dtype=dtype, device=self._device), torch.finfo(dtype).min
        masks = {kind: torch.where(torch.from_numpy(self.book.visible(query, window)).to(self._device), zero,
                                   blocked)[:, None]
                 for kind, window in self._windows.items()}
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _merge(self, solo, length: int) -> None:
        """Add the prefilled cache ``solo`` as the last row, padding the shorter side's columns."""
        first = not self.keys
        self.book.add_row(length)
        if first:
            self.cache = solo
            return
        columns = self.book.columns
        for layer, new in zip(self._layers(), [layer for layer in solo.layers if layer.is_initialized]):
            layer.keys = torch.cat([_pad(layer.keys, columns, 2), _pad(new.keys, columns, 2)], dim=0)
            layer.values = torch.cat([_pad(layer.values, columns, 2), _pad(new.values, columns, 2)], dim=0)

    def _compact(self) -> None:
        order = torch.from_numpy(self.book.compaction()).to(self._device)
        for layer in self._layers():
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)


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
