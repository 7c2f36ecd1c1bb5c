"""The flattened batch layout on PyTorch: every live sequence's cache in the columns of one row,
every verify block end to end with per-token positions (vLLM's layout, without a paged kernel).

Beside :class:`~speculant.backends.torch.batch.TorchBatch` (one row per sequence, blocks padded
to the widest) so the two can be measured against each other (issue #39, docs/batching.md): a
flattened block computes ``sum(widths)`` tokens where the padded one computes
``rows x widest``, but without a variable-length attention kernel (CPUs and MPS have none) each
token's attention reads every sequence's columns through the mask, so attention costs ``rows``
times the padded layout's. Attention-only targets (full and sliding layers); a Gated DeltaNet
layer keeps a state per sequence, which a single row cannot hold.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from speculant.backends.torch.batch import LINEAR, TorchBatch, _attention_layers
from speculant.core.batch_book import FlatBook
from speculant.core.types import Capture, ForwardOutput


class TorchFlatBatch(TorchBatch):
    """The live sequences of one batch over ``target``, flattened into one cache row."""

    padded = False
    join_tokens = 0  # its cache is one row: a joining group's padded rows would need flattening first

    def __init__(self, target) -> None:
        if LINEAR in (target.info.layer_types or ()):
            raise ValueError(f"the flattened batch layout holds no per-sequence Gated DeltaNet states "
                             f"(target family {target.info.model_type}); use the padded layout")
        super().__init__(target)

    def _empty(self) -> None:
        self.cache = self._new_cache()
        self.book = FlatBook(self.compact_at)

    def snapshot(self, key: Hashable) -> None:
        """None: a sequence's columns lie among the others' in the one row (not stored yet; a
        join still restores from a snapshot the target or a padded batch took)."""
        return None

    @torch.inference_mode()
    def _drop_rows(self, rows: list[int]) -> None:
        self.book.drop_rows(rows)
        if self.book.wants_compaction():
            self._compact()

    def tree_problem(self) -> str:
        return "the flattened batch layout verifies chains (a tree's ancestor mask is not laid out in its one row)"

    @torch.inference_mode()
    def verify(self, blocks: Sequence[Sequence[int]], capture: Capture = Capture(), trees=None) -> list[ForwardOutput]:
        self._between_cycles("verify")
        widths = self._checked_widths(blocks, trees)
        ids = torch.as_tensor([token for block in blocks for token in block], device=self._device)[None]
        query, owner = self.book.open_block(widths)
        device = self._device
        mask = self._masks(lambda window: torch.from_numpy(self.book.visible(query, owner, window)).to(device)[None])
        logits, features, final = self._forward(ids, self.cache, capture, logits_to_keep=0, attention_mask=mask,
                                                position_ids=torch.from_numpy(query).to(self._device)[None])
        starts = [0, *torch.tensor(widths).cumsum(0).tolist()]
        return [ForwardOutput(logits=logits[0, a:b], features=None if features is None else features[0, a:b],
                              final_hidden=None if final is None else final[0, a:b])
                for a, b in zip(starts, starts[1:])]

    @torch.inference_mode()
    def crop(self, lengths: Sequence[int], paths=None) -> None:
        if self.book.crop(lengths, self.keys):
            self._compact()

    def _append(self, solo) -> None:
        """Add ``solo``'s columns after the others'."""
        for layer, new in zip(_attention_layers(self.cache), _attention_layers(solo)):
            layer.keys = torch.cat([layer.keys, new.keys], dim=2)
            layer.values = torch.cat([layer.values, new.values], dim=2)

    def _compact(self) -> None:
        order = torch.from_numpy(self.book.compaction()).to(self._device)
        for layer in _attention_layers(self.cache):
            layer.keys, layer.values = layer.keys.index_select(2, order), layer.values.index_select(2, order)
