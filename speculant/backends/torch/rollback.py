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
  recurrent state (``[heads, key_dim, value_dim]``, updated every token) is not: before 5.25
  transformers keeps only the state after the whole block. So during a verify forward
  (``TorchTarget.forward``, never the prefill) the delta rule runs token by token, as plain
  decoding runs it, and keeps the state after every position of the block; the crop installs the
  one at the accepted length. No second forward, no re-run over accepted tokens (the approach of
  vLLM and SGLang for hybrids). transformers 5.25 can keep such states itself
  (``recurrent_states_to_keep``), one single-token call per kept position; the cache asks it for
  none and hands it ours instead, so its crop installs the state ours would.

How the states get out of the layer: a Gated DeltaNet layer calls the module-level function
``torch_chunk_gated_delta_rule`` (a block) or ``torch_recurrent_gated_delta_rule`` (one token) of its
transformers modeling module. :func:`install_recording` replaces both with a wrapper that
delegates unchanged unless a :class:`RollbackCache` is verifying a block of two or more tokens;
then it runs :func:`recurrent_with_states` (the token loop, on CPU) or
:func:`closed_form_with_states` (the whole block in a few batched matmuls, on accelerators, where
the loop's small kernel launches would dominate) and hands the per-position states to that cache. The
layer next calls ``cache.update_recurrent_state(final_state, layer_idx)``, which files them under
the layer. A crop that must roll back a linear layer for which no states were filed (another
kernel ran, an unknown family) raises instead of leaving a wrong state behind. On the compiled
path the wrapper hands the states to ``recording_static.RecordingStaticCache`` instead, and finds it
through :data:`COMPILED` while a graph is traced (dynamo cannot read the ContextVar).

Memory: while a block is verified, ``block × state`` float32 per linear layer, e.g. a 16-token
block of a model with 32 value heads of 128 × 128 keeps 16 × 2 MiB = 32 MiB per linear layer
(about 1.1 GiB over Qwen3-Next-80B's 36 linear layers); freed by the crop. Numerics: the
recurrence is transformers' ``torch_recurrent_gated_delta_rule`` step for step, the one plain
decoding uses without the ``flash-linear-attention`` kernels, so on CPU a verified row is computed
exactly as plain decoding computes it. The closed form (and, with those kernels installed, plain
decoding's fused kernel) agree with it up to float rounding.
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

from speculant.backends.torch.tree import active_parents

DELTA_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")

_VERIFYING: ContextVar["RollbackCache | None"] = ContextVar("speculant_verifying_cache", default=None)


class _Compiled:
    """The cache a compiled forward records into (``recording_static.py``): dynamo cannot read a
    ContextVar, so a compiled graph reads this attribute instead (and guards on it)."""

    cache = None


COMPILED = _Compiled()


def _recording_cache():
    return COMPILED.cache if torch.compiler.is_compiling() else _VERIFYING.get()


@contextmanager
def recording_into(cache) -> Iterator[None]:
    """Hand the per-position recurrent states of the forward run inside, eager or compiled, to ``cache``."""
    token, previous = _VERIFYING.set(cache), COMPILED.cache
    COMPILED.cache = cache
    try:
        yield
    finally:
        _VERIFYING.reset(token)
        COMPILED.cache = previous


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
        try:
            with recording_into(self):
                yield
        finally:
            self._handed = None

    def hand_over(self, states: list[torch.Tensor]) -> None:
        self._handed = states

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """The delta-rule wrapper records a block's per-position states, so the layer keeps its one
        chunked pass (transformers >= 5.25 would otherwise split off a token loop of its own)."""
        return 0

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        full = super().update_conv_state(conv_states, layer_idx, state_idx, **kwargs)
        _kernel_wide(self.layers[layer_idx], state_idx)  # the forward convolves ``full``, as returned
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        if self._handed is not None:
            self.block_states[layer_idx] = self._handed
            if _keeps_history(self.layers[layer_idx]):
                # transformers >= 5.25 crops a linear layer to a state it kept itself: give it ours
                recurrent_states = self._handed
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
        recorded = [
            (layer, self._recorded(index, layer, tokens_to_remove))
            for index, layer in enumerate(self.layers)
            if tokens_to_remove > 0 and _has_recurrent_state(layer)
        ]
        self.crop(-tokens_to_remove)
        for layer in self.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                _kernel_wide(layer, 0)
        for layer, states in recorded:  # after the crop, which may install a state of its own
            ROLLBACK.install(layer, states, len(states) - tokens_to_remove)
        self.block_states.clear()
        self.block_length = 0

    def _recorded(self, index: int, layer, tokens_to_remove: int) -> list[torch.Tensor]:
        states = self.block_states.get(index)
        if states is None or tokens_to_remove >= len(states):
            raise RuntimeError(
                f"layer {index} ({type(layer).__name__}) has a recurrent state but no per-position states "
                "were recorded for the last block, so it cannot be rolled back"
            )
        return states

    def _all_full_attention(self) -> bool:
        return all(type(layer).__name__ == "DynamicLayer" for layer in self.layers)


def _kernel_wide(layer, state_idx: int) -> None:
    """At least the kernel's convolution inputs in ``layer``: recording its past, transformers keeps
    them unpadded, so a context shorter than the kernel left fewer, which a batch row (always the
    kernel's) or a tree's windows cannot take. The missing ones are zeros, before the sequence's
    start, as the convolution pads them."""
    conv, size = layer.conv_states.get(state_idx), layer.conv_kernel_size.get(state_idx)
    if conv is not None and size is not None and conv.shape[-1] < size:
        layer.conv_states[state_idx] = torch.nn.functional.pad(conv, (size - conv.shape[-1], 0))


def _keeps_history(layer) -> bool:
    """Whether the layer keeps per-position recurrent states for its own crop (transformers >= 5.25)."""
    return hasattr(layer, "recurrent_states_history")


def _has_recurrent_state(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin) and any(layer.is_recurrent_states_initialized.values())


class _Rollback:
    """Installs the recurrent state after ``kept`` block rows. A seam for the test that proves
    the rollback matters (``keep_whole_block`` keeps the state after the whole block instead).
    ``closed_form``: record with :func:`closed_form_with_states` (True), the token loop (False),
    or the loop on CPU and the closed form on accelerators, where the loop's many small kernel
    launches would cost more than the block's matmuls (None)."""

    keep_whole_block = False
    closed_form: bool | None = None

    def uses_closed_form(self, device: torch.device) -> bool:
        return device.type != "cpu" if self.closed_form is None else self.closed_form

    def install(self, layer, states: list[torch.Tensor], kept: int) -> None:
        chosen = states[-1] if self.keep_whole_block else states[kept - 1]
        # a copy of its own: the chosen state may be a view of the whole block's states (closed form),
        # which transformers >= 5.25's crop would otherwise keep alive as the layer's state
        layer.recurrent_states[0] = chosen.clone()


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
        initial_state = kwargs.get("initial_state")
        plain = (
            query.shape[1] < 2
            or (cache := _recording_cache()) is None
            or args
            or initial_state is None
            or not kwargs.get("output_final_state")
            or kwargs.get("cu_seqlens") is not None
        )
        if plain:
            return original(query, key, value, *args, **kwargs)
        record = closed_form_with_states if ROLLBACK.uses_closed_form(query.device) else recurrent_with_states
        parents = active_parents()
        if parents is not None:  # a tree forward: each node from its parent's state (tree.py)
            record = functools.partial(recurrent_with_states, parents=parents)
        out, states = record(
            query, key, value, kwargs["g"], kwargs["beta"], initial_state,
            bool(kwargs.get("use_qk_l2norm_in_kernel")), l2norm,
        )
        cache.hand_over(states)
        return out, states[-1]

    delta_rule.speculant_records = True
    return delta_rule


def _prepared(query, key, value, g, beta, use_qk_l2norm: bool, l2norm):
    """What transformers' delta rules do first: heads grouped, float32 ``[batch, heads, rows, ...]``,
    query and key L2-normalised, query scaled."""
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
    return query / (query.shape[-1] ** 0.5), key, value, g, beta


def recurrent_with_states(query, key, value, g, beta, initial_state, use_qk_l2norm: bool, l2norm=None,
                          parents=None):
    """transformers' ``torch_recurrent_gated_delta_rule``, step for step, also returning the
    recurrent state after every position (``[batch, v_heads, k_dim, v_dim]`` each). With
    ``parents`` (a draft tree's), position ``i`` starts from its parent's state, not the previous one."""
    dtype = query.dtype
    query, key, value, g, beta = _prepared(query, key, value, g, beta, use_qk_l2norm, l2norm or _l2norm)
    initial = state = initial_state.to(value)
    out = torch.zeros_like(value)
    states = []
    for i in range(query.shape[2]):
        if parents is not None:
            state = initial if parents[i] < 0 else states[parents[i]]
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
        states.append(state)
    return out.transpose(1, 2).contiguous().to(dtype), states


def closed_form_with_states(query, key, value, g, beta, initial_state, use_qk_l2norm: bool, l2norm=None):
    """The same recurrence solved for the whole block at once (a few batched matmuls, no loop per
    token), equal to :func:`recurrent_with_states` up to float rounding.

    With ``D[t, j] = exp(g_{j+1} + ... + g_t)`` (j <= t), the per-row updates
    ``u_t = beta_t (v_t - k_t . decayed S_{t-1})`` solve the unit lower-triangular system
    ``u_t + sum_{j<t} beta_t (k_t . k_j) D[t, j] u_j = beta_t v_t - beta_t D[t, -1] k_t . S_0``, and
    then ``S_t = D[t, -1] S_0 + sum_{j<=t} D[t, j] k_j u_j^T`` and ``o_t = q_t . S_t``."""
    dtype = query.dtype
    query, key, value, g, beta = _prepared(query, key, value, g, beta, use_qk_l2norm, l2norm or _l2norm)
    state = initial_state.to(value)  # [b, h, dk, dv]
    rows = query.shape[2]
    cum = g.cumsum(dim=-1)  # [b, h, t]
    causal = torch.ones(rows, rows, dtype=torch.bool, device=query.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # D[t, j]
    k_beta = key * beta[..., None]
    system = (k_beta @ key.transpose(-1, -2)) * decay  # its strictly lower part; the diagonal is taken as 1
    start = (k_beta * cum.exp()[..., None]) @ state  # beta_t D[t, -1] k_t . S_0
    updates = torch.linalg.solve_triangular(system, value * beta[..., None] - start, upper=False, unitriangular=True)
    outer = (key[..., :, None] * updates[..., None, :]).flatten(-2)  # k_j u_j^T, [b, h, t, dk * dv]
    states = (decay @ outer).unflatten(-1, state.shape[-2:]) + cum.exp()[..., None, None] * state[:, :, None]
    out = (query[..., None] * states).sum(dim=-2)  # [b, h, t, dv]
    return out.transpose(1, 2).contiguous().to(dtype), list(states.unbind(dim=2))


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
