"""Gated DeltaNet layers on the compiled path: a static cache that keeps what a rollback needs.

A linear-attention layer of transformers' ``StaticCache`` holds two fixed-size states, the short
convolution's last ``conv_kernel`` inputs and the recurrent state, and overwrites both in place at
every forward. Rolling a verify block back to ``kept`` of its positions needs them as they were
after ``kept`` positions, so :class:`RecordingStaticCache` also writes, inside the forward (eager or
compiled, every buffer preallocated at a fixed address):

- ``conv_record[layer]`` ``[batch, conv_dim, kernel + widest]``: the convolution's inputs, the
  state before the forward then the forward's own rows. The state after ``kept`` positions is
  columns ``kept .. kept + kernel``.
- ``state_record[layer]`` ``[widest + 1, batch, heads, key_dim, value_dim]``: the recurrent state
  before the forward (row 0) and after each of its positions. A block's per-position states come
  from the delta-rule wrapper of ``rollback.py`` (``hand_over``), the same recurrence the eager
  RollbackCache records.

:meth:`RecordingStaticCache.roll_back_to` copies the states after ``kept`` positions back into
place. Nothing is recomputed, and the forward that wrote the record is not run again.

A one-token step records too (the state before it), so the pipelined plain decoder, which runs a
step ahead, can take its last step back.

Memory: ``widest + 1`` recurrent states per linear layer, kept for the engine's life (e.g. 17 x
2 MiB for a layer of 32 value heads of 128 x 128 at ``widest`` 16; the eager path holds a block's
worth only while it is verified). Recording is a module-level switch (``rollback.COMPILED``) while
a compiled forward runs, so two engines must not run compiled hybrid forwards in two threads of
one process at once (dynamo cannot read a ContextVar, which the eager path uses).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

RECORDED_WIDTH = 16  # the widest forward a record holds at first; a wider one rebuilds the cache


class RecordingStaticCache(StaticCache):
    """A StaticCache whose linear-attention layers record each forward's states while ``recording``."""

    def __init__(self, config, max_cache_len: int, widest: int = RECORDED_WIDTH) -> None:
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.widest = widest
        self.recording = False  # a verify block or decode step (not a prompt chunk) is running
        self.conv_record: dict[int, torch.Tensor] = {}
        self.state_record: dict[int, torch.Tensor] = {}
        self._handed: list[torch.Tensor] | None = None

    def hand_over(self, states: list[torch.Tensor]) -> None:
        """The recurrent state after every position of the block being verified (rollback.py)."""
        self._handed = states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        state = super().get_conv_state(layer_idx, state_idx)
        if self.recording and state is not None:
            self.conv_record[layer_idx][..., : state.shape[-1]].copy_(state)
        return state

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        full = super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        if self.recording:  # the state before this forward, then its rows
            self.conv_record[layer_idx][..., : full.shape[-1]].copy_(full)
        elif layer_idx not in self.conv_record:  # a prompt chunk, always eager: allocate here, not in a graph
            conv = self.layers[layer_idx].conv_states[state_idx]
            self.conv_record[layer_idx] = _fixed(conv.new_zeros(*conv.shape[:-1], conv.shape[-1] + self.widest))
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        state = super().get_recurrent_state(layer_idx, state_idx)
        if self.recording and state is not None:
            self.state_record[layer_idx][0].copy_(state)
        return state

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        if self.recording:
            after = recurrent_states[None] if self._handed is None else torch.stack(self._handed)
            self.state_record[layer_idx][1 : 1 + after.shape[0]].copy_(after)
            self._handed = None
        out = super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)
        if not self.recording and layer_idx not in self.state_record:
            state = self.layers[layer_idx].recurrent_states[state_idx]
            self.state_record[layer_idx] = _fixed(state.new_zeros(self.widest + 1, *state.shape))
        return out

    def roll_back_to(self, kept: int) -> None:
        """Put every linear layer's states back to what they were after ``kept`` positions of the
        last recorded forward (0: before it)."""
        for index, states in self.state_record.items():
            layer = self.layers[index]
            layer.recurrent_states[0].copy_(states[kept])
            kernel = layer.conv_states[0].shape[-1]
            layer.conv_states[0].copy_(self.conv_record[index][..., kept : kept + kernel])

    def keep_path(self, rows: list[int]) -> None:
        """After a draft tree's forward (its nodes recorded in node order, each from its parent's
        state): every linear layer's states as after the nodes ``rows`` alone, in order."""
        for index, states in self.state_record.items():
            layer = self.layers[index]
            layer.recurrent_states[0].copy_(states[1 + rows[-1]])
            kernel = layer.conv_states[0].shape[-1]
            columns = [*range(kernel), *(kernel + r for r in rows)][-kernel:]
            layer.conv_states[0].copy_(self.conv_record[index][..., columns])

    def restart(self) -> None:
        """Zero every linear layer's states for a new request (attention rows are masked by position)."""
        for index in self.state_record:
            self.layers[index].reset()


def _fixed(buffer: torch.Tensor) -> torch.Tensor:
    """Mark ``buffer``'s address as fixed, as transformers marks its static cache's, so that CUDA
    graphs write it in place rather than treating it as an input that changes."""
    torch._dynamo.mark_static_address(buffer)
    return buffer
