"""Exact rollback of a PyTorch target's caches to any accepted prefix of the block just verified.

After every verify forward the engine crops the target to the accepted length. What that takes,
per layer kind (``TargetInfo.layer_types``):

- ``full_attention``: drop the rejected rows (transformers' ``DynamicLayer.crop``).
- ``sliding_attention``: once the window is full, a plain sliding layer has already dropped the
  rows a rejected block needs back. With past recording (``Cache.activate_past_recording``) the
  layer keeps every row a forward adds until the next crop, which removes the rejected rows and
  trims the buffer back to ``window - 1`` rows. The target crops after every forward, prefill
  included, so the buffers never stay longer than the window plus one block.
- ``linear_attention`` (Gated DeltaNet of Qwen3.5 / Qwen3-Next): two states per layer. The short
  convolution state (last ``conv_kernel - 1`` inputs) is rolled back by past recording too. The
  recurrent state (``[heads, key_dim, value_dim]``, updated every token) is not: transformers can
  only keep the state after the whole block. So during a verify forward (``TorchTarget.forward``,
  never the prefill) the delta rule runs token by token, as plain decoding runs it, and keeps the
  state after every position of the block; the crop installs the one at the accepted length. No
  second forward, no re-run over accepted tokens (the approach of vLLM and SGLang for hybrids).

How the states get out of the layer: a Gated DeltaNet layer calls the module-level function
``torch_chunk_gated_delta_rule`` (a block) or ``torch_recurrent_gated_delta_rule`` (one token) of its
transformers modeling module. :func:`install_recording` replaces both with a wrapper that
delegates unchanged unless a :class:`RollbackCache` is verifying a block of two or more tokens;
then it runs :func:`recurrent_with_states` and hands the per-position states to that cache. The
layer next calls ``cache.update_recurrent_state(final_state, layer_idx)``, which files them under
the layer. A crop that must roll back a linear layer for which no states were filed (another
kernel ran, an unknown family) raises instead of leaving a wrong state behind.

Memory: while a block is verified, ``block × state`` float32 per linear layer, e.g. a 16-token
block of a model with 32 value heads of 128 × 128 keeps 16 × 2 MiB = 32 MiB per linear layer
(about 1.1 GiB over Qwen3-Next-80B's 36 linear layers); freed by the crop. Numerics: the
recurrence is transformers' ``torch_recurrent_gated_delta_rule`` step for step, the one plain
decoding uses without the ``flash-linear-attention`` kernels (with them, plain decoding uses their
fused kernel and the verify forward this reference loop, equal up to float rounding).
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

DELTA_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

_VERIFYING: ContextVar["RollbackCache | None"] = ContextVar("speculant_verifying_cache", default=None)


class RollbackCache(DynamicCache):
    """A DynamicCache with past recording that rolls back to any prefix of the last block."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.activate_past_recording()
        self.block_states: dict[int, list[torch.Tensor]] = {}  # layer -> recurrent state after each block row
        self._handed: list[torch.Tensor] | None = None
        self.block_length = 0  # rows added since the last crop

    @contextmanager
    def verifying(self) -> Iterator[None]:
        """Keep the per-position recurrent states of the forward run inside."""
        self.block_states.clear()
        token = _VERIFYING.set(self)
        try:
            yield
        finally:
            _VERIFYING.reset(token)
            self._handed = None

    def hand_over(self, states: list[torch.Tensor]) -> None:
        self._handed = states

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        if self._handed is not None:
            self.block_states[layer_idx] = self._handed
            self._handed = None
        return super().update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def rollback(self, tokens_to_remove: int) -> None:
        """Drop the last ``tokens_to_remove`` positions (within the last block) and trim every
        buffer back to what the next forward needs; 0 only trims."""
        if tokens_to_remove > self.block_length and not self._all_full_attention():
            raise RuntimeError(
                f"cannot roll back {tokens_to_remove} positions: only the last {self.block_length} "
                "(the block since the last crop) are recorded"
            )
        if tokens_to_remove > 0:
            for index, layer in enumerate(self.layers):
                if _has_recurrent_state(layer):
                    self._install(index, layer, tokens_to_remove)
        self.block_states.clear()
        self.crop(-tokens_to_remove)
        self.block_length = 0

    def _install(self, index: int, layer, tokens_to_remove: int) -> None:
        states = self.block_states.get(index)
        if states is None or tokens_to_remove >= len(states):
            raise RuntimeError(
                f"layer {index} ({type(layer).__name__}) has a recurrent state but no per-position states "
                "were recorded for the last block, so it cannot be rolled back"
            )
        ROLLBACK.install(layer, states, len(states) - tokens_to_remove)

    def _all_full_attention(self) -> bool:
        return all(type(layer).__name__ == "DynamicLayer" for layer in self.layers)


def _has_recurrent_state(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin) and any(layer.is_recurrent_states_initialized.values())


class _Rollback:
    """Installs the recurrent state after ``kept`` block rows. A seam for the test that proves
    the rollback matters (``keep_whole_block`` keeps the state after the whole block instead)."""

    keep_whole_block = False

    def install(self, layer, states: list[torch.Tensor], kept: int) -> None:
        chosen = states[-1] if self.keep_whole_block else states[kept - 1]
        layer.recurrent_states[0].copy_(chosen)


ROLLBACK = _Rollback()


def install_recording(model: torch.nn.Module) -> set[int]:
    """Wrap the delta-rule functions of the modeling module of every Gated DeltaNet layer in
    ``model``; returns the indices of the layers covered."""
    covered: set[int] = set()
    for layer in model.modules():
        if "GatedDeltaNet" not in type(layer).__name__:
            continue
        module = sys.modules.get(type(layer).__module__)
        if module is None or not all(callable(getattr(module, name, None)) for name in DELTA_RULES):
            continue
        for name in DELTA_RULES:
            function = getattr(module, name)
            if not getattr(function, "speculant_records", False):
                setattr(module, name, _recording(function, getattr(module, "l2norm", _l2norm)))
        covered.add(int(layer.layer_idx))
    return covered


def _recording(original: Callable, l2norm: Callable) -> Callable:
    @functools.wraps(original)
    def delta_rule(query, key, value, *args, **kwargs):
        cache = _VERIFYING.get()
        initial_state = kwargs.get("initial_state")
        plain = (
            cache is None
            or args
            or initial_state is None
            or not kwargs.get("output_final_state")
            or kwargs.get("cu_seqlens") is not None
            or query.shape[1] < 2
        )
        if plain:
            return original(query, key, value, *args, **kwargs)
        out, states = recurrent_with_states(
            query, key, value, kwargs["g"], kwargs["beta"], initial_state,
            bool(kwargs.get("use_qk_l2norm_in_kernel")), l2norm,
        )
        cache.hand_over(states)
        return out, states[-1]

    delta_rule.speculant_records = True
    return delta_rule


def recurrent_with_states(query, key, value, g, beta, initial_state, use_qk_l2norm: bool, l2norm=None):
    """transformers' ``torch_recurrent_gated_delta_rule``, step for step, also returning the
    recurrent state after every position (``[batch, v_heads, k_dim, v_dim]`` each)."""
    l2norm = l2norm or _l2norm
    dtype = query.dtype
    k_heads, v_heads = key.shape[2], value.shape[2]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, g = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm:
        query = l2norm(query, dim=-1, eps=1e-6)
        key = l2norm(key, dim=-1, eps=1e-6)
    query = query / (query.shape[-1] ** 0.5)
    state = initial_state.to(value)
    out = torch.zeros_like(value)
    states = []
    for i in range(query.shape[2]):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
        states.append(state)
    return out.transpose(1, 2).contiguous().to(dtype), states


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
