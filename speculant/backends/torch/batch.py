"""Several live sequences verified in one forward of a PyTorch target (issue #39, docs/batching.md).

A :class:`TorchBatch` holds the rows of its sequences in one cache of its own, beside the
target's single-sequence cache. Each sequence joins with its prompt (prefilled alone, then merged
in as a new row), and between cycles leaves; each cycle :meth:`TorchBatch.verify` runs every
sequence's anchor + drafts (ragged widths) in one forward and :meth:`TorchBatch.crop` rolls each
sequence back to its own accepted length.

Layout: one rectangular cache ``[batch, heads, columns, dim]`` with, per row, which columns hold
its positions (``valid``) and the position each column holds (``positions``); a verify block is
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
behind is future work). Gated DeltaNet (``linear_attention``) is refused (:func:`batch_problem`):
its per-row recurrent and convolution states need per-position recording per row, not done yet.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from transformers import DynamicCache

from speculant.core.batch import BatchedTarget
from speculant.core.types import Capture, ForwardOutput, TargetInfo

_BATCHED_KINDS = ("full_attention", "sliding_attention")


def batch_problem(info: TargetInfo) -> str | None:
    """Why the target's layers cannot be verified batched, or None."""
    refused = sorted({kind for kind in info.layer_types if kind not in _BATCHED_KINDS})
    if not refused:
        return None
    return (f"batched verify does not roll back {', '.join(refused)} layers per sequence yet "
            f"(target family {info.model_type}); it batches {' and '.join(_BATCHED_KINDS)} only")


class TorchBatch(BatchedTarget):
    """The live sequences of one batch over ``target`` (a ``TorchTarget``), row ``i`` being ``keys[i]``."""

    compact_at = 0.25  # squeeze the holes out once they are this share of the cache's cells

    def __init__(self, target) -> None:
        problem = batch_problem(target.info)
        if problem is not None:
            raise ValueError(problem)
        self.target = target
        self.keys: list[Hashable] = []
        self._device = target.model.device
        self._kinds = tuple(dict.fromkeys(target.info.layer_types or ("full_attention",)))
        self._window = target.info.sliding_window
        self._empty()

    def _empty(self) -> None:
        self.cache = DynamicCache()  # every layer a full-length DynamicLayer; sliding ones are masked
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self._device)  # [rows, columns]
        self.positions = torch.zeros((0, 0), dtype=torch.long, device=self._device)
        self._block: tuple[torch.Tensor, list[int]] | None = None  # (lengths before, widths) of the last verify

    @property
    def lengths(self) -> list[int]:
        """Each sequence's cache length (positions held), in row order."""
        return self.valid.sum(dim=1).tolist()

    def lengths_before_block(self) -> list[int]:
        """Each sequence's cache length before the last verified block (what :meth:`crop` starts from)."""
        if self._block is None:
            raise RuntimeError("no block was verified since the last crop")
        return self._block[0].tolist()

    @torch.inference_mode()
    def join(self, key: Hashable, token_ids: Sequence[int], capture: Capture = Capture()) -> ForwardOutput:
        """Prefill a new sequence ``key`` alone and add it as the last row; logits of its last
        prompt position, captured states of every one. Only between cycles."""
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
        """Drop sequence ``key`` and its rows. Only between cycles."""
        self._between_cycles("leave")
        row = self.keys.index(key)
        del self.keys[row]
        if not self.keys:
            self._empty()
            return
        kept = torch.tensor([i for i in range(len(self.keys) + 1) if i != row], device=self._device)
        for layer in self._layers():
            layer.keys, layer.values = layer.keys.index_select(0, kept), layer.values.index_select(0, kept)
        self.valid, self.positions = self.valid.index_select(0, kept), self.positions.index_select(0, kept)
        self._compact()  # the trailing columns only the row that left used

    @torch.inference_mode()
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture()) -> list[ForwardOutput]:
        """Run ``blocks[i]`` (anchor + drafts of sequence ``keys[i]``, one token or more) after each
        sequence's cache, all in one forward; per sequence, logits and captured states of its rows."""
        self._between_cycles("verify")
        if len(blocks) != len(self.keys):
            raise ValueError(f"verify got {len(blocks)} blocks for a batch of {len(self.keys)} sequences")
        widths = [len(block) for block in blocks]
        if min(widths, default=0) < 1:
            raise ValueError(f"every sequence's block needs its anchor token; widths were {widths}")
        widest = max(widths)
        ids = torch.zeros((len(blocks), widest), dtype=torch.long, device=self._device)  # 0: padding, masked
        for row, block in enumerate(blocks):
            ids[row, : len(block)] = torch.as_tensor(list(block), device=self._device)
        lengths = self.valid.sum(dim=1)
        query_positions = lengths[:, None] + torch.arange(widest, device=self._device)
        mask = self._mask(query_positions)
        logits, features, final = self._forward(ids, self.cache, capture, logits_to_keep=0,
                                                attention_mask=mask, position_ids=query_positions)
        in_block = torch.arange(widest, device=self._device)[None, :] < torch.tensor(widths, device=self._device)[:, None]
        self.valid = torch.cat([self.valid, in_block], dim=1)
        self.positions = torch.cat([self.positions, query_positions], dim=1)
        self._block = (lengths, widths)
        return [ForwardOutput(logits=logits[row, :width], features=_row(features, row, width),
                              final_hidden=_row(final, row, width))
                for row, width in enumerate(widths)]

    @torch.inference_mode()
    def crop(self, lengths: Sequence[int]) -> None:
        """After :meth:`verify`: keep each sequence's first ``lengths[i]`` positions, between its
        length before the block and that plus its block's width (each its own accepted length)."""
        if self._block is None:
            raise RuntimeError("crop rolls back the last verify block; no block was verified since the last crop")
        before, widths = self._block
        if len(lengths) != len(widths):
            raise ValueError(f"crop got {len(lengths)} lengths for a batch of {len(widths)} sequences")
        start = int(self.valid.shape[1]) - max(widths)  # the block's first column
        for row, (length, first, width) in enumerate(zip(lengths, before.tolist(), widths)):
            if not first <= length <= first + width:
                raise ValueError(f"sequence {self.keys[row]!r}: crop to {length} outside its last block "
                                 f"({first} .. {first + width} positions)")
            self.valid[row, start + length - first:] = False
        self._block = None
        holes = self.valid.numel() - int(self.valid.sum())
        if holes > self.compact_at * self.valid.numel():
            self._compact()

    def _between_cycles(self, what: str) -> None:
        if self._block is not None:
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

    def _mask(self, query_positions: torch.Tensor):
        """The additive mask ``[rows, 1, widest, columns + widest]`` per attention kind: a query
        sees its own sequence's held columns and its block's earlier rows (within the window on
        sliding layers); one tensor for one kind, else a dict by ``layer_types`` name."""
        key_positions = torch.cat([self.positions, query_positions], dim=1)  # [rows, columns + widest]
        held = torch.cat([self.valid, torch.ones_like(query_positions, dtype=torch.bool)], dim=1)
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [rows, widest, columns + widest]
        causal = held[:, None, :] & (distance >= 0)
        dtype = self.target.model.dtype
        zero, blocked = torch.zeros((), dtype=dtype, device=self._device), torch.finfo(dtype).min
        masks = {}
        for kind in self._kinds:
            allowed = causal & (distance < self._window) if kind == "sliding_attention" else causal
            masks[kind] = torch.where(allowed, zero, blocked)[:, None]
        return masks[self._kinds[0]] if len(masks) == 1 else masks

    def _merge(self, solo, length: int) -> None:
        """Add the prefilled cache ``solo`` as the last row, padding the shorter side's columns."""
        if not self.keys:
            self.cache = solo
            self.valid = torch.ones((1, length), dtype=torch.bool, device=self._device)
            self.positions = torch.arange(length, device=self._device)[None, :]
            return
        columns = max(int(self.valid.shape[1]), length)
        for layer, new in zip(self._layers(), [layer for layer in solo.layers if layer.is_initialized]):
            layer.keys = torch.cat([_pad(layer.keys, columns, 2), _pad(new.keys, columns, 2)], dim=0)
            layer.values = torch.cat([_pad(layer.values, columns, 2), _pad(new.values, columns, 2)], dim=0)
        valid = torch.ones((1, length), dtype=torch.bool, device=self._device)
        positions = torch.arange(length, device=self._device)[None, :]
        self.valid = torch.cat([_pad(self.valid, columns, 1), _pad(valid, columns, 1)], dim=0)
        self.positions = torch.cat([_pad(self.positions, columns, 1), _pad(positions, columns, 1)], dim=0)

    def _compact(self) -> None:
        """Each row's held columns first, in order, the rest dropped down to the longest row's count."""
        counts = self.valid.sum(dim=1)
        longest = int(counts.max())
        order = torch.argsort((~self.valid).to(torch.int8), dim=1, stable=True)[:, :longest]  # [rows, longest]
        for layer in self._layers():
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
        self.positions = self.positions.gather(1, order)
        self.valid = torch.arange(longest, device=self._device)[None, :] < counts[:, None]


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
