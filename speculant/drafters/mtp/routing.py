"""Mixture-of-experts routing for MTP blocks, written once over a backend's few array functions.

- **softmax** (Qwen3-Next, Qwen3.5/3.6-MoE): p = softmax(router logits); the top-k experts by p,
  weights p renormalised over the k when ``norm_topk_prob``.
- **sigmoid** (DeepSeek-V3): s = sigmoid(logits); experts are *chosen* by s + e_score_correction_bias,
  restricted to the ``topk_group`` groups (of ``n_group``) whose two best biased scores sum highest;
  weights are the unbiased s of the chosen experts, renormalised when ``norm_topk_prob``, then
  times ``routed_scaling_factor``.

The order of the k chosen experts is unspecified (their weighted sum does not depend on it).
"""

from __future__ import annotations

from typing import Any, Protocol

from speculant.drafters.mtp.config import MoESpec


class RouterOps(Protocol):
    """Array functions over the last axis; arrays also support reshape, arithmetic, comparisons."""

    def softmax(self, x: Any) -> Any: ...
    def sigmoid(self, x: Any) -> Any: ...
    def top_k(self, x: Any, k: int) -> Any:
        """Indices of the k largest entries (any order)."""
    def take(self, x: Any, indices: Any) -> Any:
        """x gathered at ``indices`` along the last axis."""
    def min(self, x: Any) -> Any:
        """Minimum over the last axis, kept as a size-1 axis."""
    def sum(self, x: Any) -> Any:
        """Sum over the last axis, kept as a size-1 axis."""
    def where(self, condition: Any, a: Any, b: float) -> Any: ...


def route(ops: RouterOps, logits, spec: MoESpec, bias=None):
    """(expert indices [n, k], weights [n, k]) from float32 router logits [n, E]."""
    if spec.scoring == "softmax":
        scores = ops.softmax(logits)
        choice = scores
    else:
        scores = ops.sigmoid(logits)
        choice = scores if bias is None else scores + bias
        if spec.topk_group < spec.n_group:
            n, experts = logits.shape
            grouped = choice.reshape(n, spec.n_group, experts // spec.n_group)
            group_scores = ops.sum(ops.take(grouped, ops.top_k(grouped, 2)))[..., 0]  # [n, G]: best two per group
            threshold = ops.min(ops.take(group_scores, ops.top_k(group_scores, spec.topk_group)))
            kept = group_scores >= threshold  # the topk_group best groups
            choice = ops.where(kept[..., None], grouped, float("-inf")).reshape(n, experts)
    indices = ops.top_k(choice, spec.top_k)
    weights = ops.take(scores, indices)
    if spec.norm_topk_prob:
        weights = weights / (ops.sum(weights) + (1e-20 if spec.scoring == "sigmoid" else 0.0))
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return indices, weights
