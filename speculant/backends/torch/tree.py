"""Tree verify forwards over a PyTorch target's :class:`RollbackCache` (docs/tree-verification.md).

One forward runs every node of a draft tree after the cache: positions ``cache + depth`` and a
custom additive 4-D mask per attention kind (the model uses a ready 4-D mask as it is). A node
sees the cached rows a chain token at its position would see (all of them under full attention;
under sliding attention those less than ``window`` positions back) and, among the tree's rows,
only its ancestors and itself. The commit then keeps, in every attention layer, the cached rows
plus the accepted path's rows in path order, exactly the rows a chain over that path would have
written.

Gated DeltaNet layers (Qwen3-Next, Qwen3.5) hold a short-convolution window and a recurrent state
per sequence. During a tree forward (:func:`tree_nodes`) the convolution of node ``i`` reads the
inputs of its own ancestors (then the cached window) instead of the nodes before it in order
(:func:`tree_conv`, in place of the modeling module's ``causal_conv1d_fn``), and the delta rule
runs node by node from the parent's state (``rollback.recurrent_with_states`` with ``parents``),
keeping every node's state. The commit keeps the cached window plus the path's inputs and installs
the state of the path's last node.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator, Sequence

import torch
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from speculant.core.tree import DraftTree, conv_windows, kept_rows


def tree_mask(cache, tree: DraftTree, dtype: torch.dtype, device: torch.device):
    """The additive mask ``[1, 1, T, visible cached rows + T]`` for every attention kind in ``cache``:
    one tensor when all layers are of one kind, else a dict by ``layer_types`` name."""
    masks = {}
    for layer in cache.layers:
        kind, window = attention_kind(layer)
        if kind is None or kind in masks:
            continue  # no mask for linear layers: tree_conv and the parent-indexed delta rule
        cached = int(layer.keys.shape[-2]) if layer.is_initialized else 0
        masks[kind] = additive_mask(tree.visibility(cached, window), dtype, device)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks


def attention_kind(layer) -> tuple[str | None, int | None]:
    """(``layer_types`` name, sliding window or None) of an eager cache layer; (None, None) for a
    linear-attention one."""
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        return None, None
    if isinstance(layer, DynamicSlidingWindowLayer):
        return "sliding_attention", layer.sliding_window
    return "full_attention", None


def additive_mask(allowed, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, 1, *allowed.shape]``: 0 where ``allowed``, the dtype's lowest value elsewhere."""
    allowed = torch.as_tensor(allowed, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


@torch.inference_mode()
def commit_path(cache, tree: DraftTree, path: Sequence[int]) -> None:
    """Keep, in every layer, the rows before the tree's rows and the rows of the nodes ``path``."""
    width = tree.size
    rows = kept_rows(tree, path)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            _commit_linear(layer, cache.block_states.get(index), width, rows)
            continue
        if not layer.is_initialized:
            continue
        kept = int(layer.keys.shape[-2]) - width  # the cached rows before the tree's
        index = torch.as_tensor(rows, device=layer.keys.device) + kept
        layer.keys = torch.cat([layer.keys[:, :, :kept], layer.keys.index_select(2, index)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :kept], layer.values.index_select(2, index)], dim=2)
        if isinstance(layer, DynamicSlidingWindowLayer):
            layer.cumulative_length -= width - len(rows)
    cache.rollback(0)  # sliding buffers back to window - 1 rows; the block is closed


def _commit_linear(layer, states: list[torch.Tensor] | None, width: int, rows: list[int]) -> None:
    """The convolution inputs before the tree's plus the path's; the recurrent state of its last node."""
    if not layer.is_conv_states_initialized[0]:
        return
    if states is None or len(states) != width:
        raise RuntimeError("a Gated DeltaNet layer kept no per-node states for the tree just verified")
    conv = layer.conv_states[0]
    index = torch.as_tensor(rows, device=conv.device) + (int(conv.shape[-1]) - width)
    layer.conv_states[0] = torch.cat([conv[..., :-width], conv.index_select(-1, index)], dim=-1)
    layer.cumulative_length_linear.sub_(width - len(rows))
    layer.recurrent_states[0] = states[rows[-1]].clone()


_PARENTS: ContextVar[tuple[int, ...] | None] = ContextVar("speculant_tree_parents", default=None)


def active_parents() -> tuple[int, ...] | None:
    """The parents of the tree being verified (node order), or None outside a tree forward. Trees
    never run compiled, and a compiled graph cannot read a ContextVar: None while compiling."""
    return None if torch.compiler.is_compiling() else _PARENTS.get()


@contextmanager
def tree_nodes(tree: DraftTree) -> Iterator[None]:
    token = _PARENTS.set(tree.parents)
    try:
        yield
    finally:
        _PARENTS.reset(token)


def install_tree_conv(model: torch.nn.Module) -> None:
    """Wrap ``causal_conv1d_fn`` of the modeling module of every Gated DeltaNet layer in ``model``:
    unchanged outside a tree forward, :func:`tree_conv` inside one."""
    for layer in model.modules():
        if "GatedDeltaNet" not in type(layer).__name__:
            continue
        module = sys.modules.get(type(layer).__module__)
        function = getattr(module, "causal_conv1d_fn", None)
        if callable(function) and not getattr(function, "speculant_tree", False):
            module.causal_conv1d_fn = _tree_aware(function)


def _tree_aware(original: Callable) -> Callable:
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        parents = active_parents()
        if parents is None or hidden_states.shape[-1] < len(parents):
            return original(hidden_states, weight, bias=bias, activation=activation, **kwargs)
        return tree_conv(hidden_states, weight, bias, activation, parents)

    causal_conv1d_fn.speculant_tree = True
    return causal_conv1d_fn


def tree_conv(hidden_states: torch.Tensor, weight: torch.Tensor, bias, activation: str | None,
              parents: Sequence[int]) -> torch.Tensor:
    """The depthwise causal convolution over ``hidden_states`` [B, C, cached + T] where the last T
    columns are tree nodes: node ``i``'s window is its ancestors' columns, then the cached ones.
    Returns [B, C, cached + T] (the cached columns' outputs are zero; callers keep the last T)."""
    nodes, kernel = len(parents), int(weight.shape[-1])
    cached = int(hidden_states.shape[-1]) - nodes
    index = torch.as_tensor(conv_windows(parents, kernel, cached), device=hidden_states.device)
    x = hidden_states.to(weight.dtype)[:, :, index]  # [B, C, T, K]
    out = (x * weight[None, :, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[None, :, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    pad = out.new_zeros((*out.shape[:2], cached))
    return torch.cat([pad, out], dim=-1).to(hidden_states.dtype)
