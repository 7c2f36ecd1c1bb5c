"""A cache layer that appends into spare room (``core/spare_room.py``): transformers'
``DynamicLayer`` concatenates its keys and values with every forward's, copying the whole cache
each cycle. :class:`GrowingLayer` writes each forward's states after the held ones and reads back
a view; assigning ``keys`` / ``values`` (a crop, a gather, a merge) takes the tensors as they are."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from speculant.core import spare_room


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` over spare-room buffers ``[batch, heads, capacity, dim]``."""

    keys = spare_room.HeldColumns()
    values = spare_room.HeldColumns()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        spare_room.append(self, key_states, value_states, lambda like, shape: like.new_zeros(shape))
        return self.keys, self.values
