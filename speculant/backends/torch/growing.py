"""A cache layer that appends into spare room: transformers' ``DynamicLayer`` concatenates its
keys and values with every forward's, copying the whole cache each cycle (at 16 rows x 4k
columns of a 36-layer model, gigabytes a cycle). :class:`GrowingLayer` writes each forward's
states after the held ones in a buffer that grows by half when full, and reads back a view.
Assigning ``keys`` / ``values`` (a crop, a gather, a merge) takes the given tensors as they are."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

SPARE = 0.5  # room added beyond what is needed when the buffer grows, as a share of it
MIN_SPARE = 64  # columns


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with ``[batch, heads, capacity, dim]`` buffers, the first ``length`` columns held."""

    def __init__(self, **kwargs) -> None:
        self._keys = self._values = None
        self._held = [0, 0]  # columns held of keys, of values (code assigns them one after the other)
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._keys is None or self._keys.dim() < 3 else self._keys[:, :, :self._held[0]]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._keys, self._held[0] = tensor, _columns(tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._values is None or self._values.dim() < 3 else self._values[:, :, :self._held[1]]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._values, self._held[1] = tensor, _columns(tensor)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held, new = self._held[0], int(key_states.shape[-2])
        if self.keys is None or self._keys.shape[-2] < held + new or self._keys.shape[0] != key_states.shape[0]:
            self._grow(key_states, value_states, held + new)
        self._keys[:, :, held:held + new] = key_states
        self._values[:, :, held:held + new] = value_states
        self._held = [held + new, held + new]
        return self.keys, self.values

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        capacity = needed + max(MIN_SPARE, int(needed * SPARE))
        held = self._held[0]
        keys = key_states.new_zeros((*key_states.shape[:2], capacity, key_states.shape[-1]))
        values = value_states.new_zeros((*value_states.shape[:2], capacity, value_states.shape[-1]))
        if held:
            keys[:, :, :held], values[:, :, :held] = self.keys, self.values
        self._keys, self._values = keys, values


def _columns(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None or tensor.dim() < 3 else int(tensor.shape[-2])
