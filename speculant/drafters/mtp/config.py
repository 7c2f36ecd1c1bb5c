"""MTP checkpoint formats: find the layout, read the layer count, check tensor headers.

Two published layouts (read from safetensors headers and config.json, no weights loaded):

- **qwen** (Qwen3-Next, Qwen3.5+): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.layers.{i}.*`` and ``mtp.norm``; the fc and the three
  norms are shared by every MTP layer. Count: ``mtp_num_hidden_layers`` (under ``text_config``
  in VLM-style configs). Every MTP norm computes x̂·(1 + w) unless the folder is pre-shifted.
- **deepseek** (DeepSeek-V3 style): ``model.layers.{num_hidden_layers + k}.{enorm, hnorm,
  eh_proj, shared_head.norm}`` plus the block, optional copies ``embed_tokens`` and
  ``shared_head.head`` (never loaded: the target's are used). Count: ``num_nextn_predict_layers``.
  Norms compute x̂·w.

The decoder block has one of two attentions and one of two MLPs:

- attention: Qwen3-style q/k/v (q/k norms for Qwen-family targets, optional Qwen3-Next output
  gate, partial rotary), or DeepSeek MLA when config.json has ``kv_lora_rank`` (``q_a_proj`` /
  ``q_a_layernorm`` / ``q_b_proj``, or ``q_proj`` when ``q_lora_rank`` is null;
  ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj``; RoPE on the
  ``qk_rope_head_dim`` part only, interleaved pairs when ``rope_interleave``).
- MLP: dense SwiGLU, or mixture-of-experts. Qwen (``num_experts`` > 0): softmax router
  ``mlp.gate``, experts ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-Next) or packed
  ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I] (Qwen3.5/3.6-MoE),
  ``mlp.shared_expert.*`` scaled by sigmoid(``mlp.shared_expert_gate``). DeepSeek
  (``n_routed_experts``, layer index >= ``first_k_dense_replace``): sigmoid router with
  ``mlp.gate.e_score_correction_bias``, group-limited top-k, ``routed_scaling_factor``,
  ``mlp.shared_experts.*``.

RoPE is default or YaRN (DeepSeek's mscale folded into the MLA softmax scale); the YaRN
frequencies are computed here once, on the host, for both backends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from speculant.core.schema import UserModel


Layout = Literal["qwen", "deepseek"]
Tap = Literal["post_norm", "pre_norm"]

# Per-family defaults (mtp-and-verification.md §1.4): Qwen/GLM feed and recycle post-norm;
# DeepSeek-V3 (as vLLM) feeds post-norm and recycles the state before shared_head.norm.
FAMILY_DEFAULTS: dict[str, dict] = {
    "qwen": {"hidden_tap": "post_norm", "recycle_hidden": "post_norm", "norm_offset": 1.0},
    "deepseek": {"hidden_tap": "post_norm", "recycle_hidden": "pre_norm", "norm_offset": 0.0},
}
COUNT_KEYS = {"qwen": "mtp_num_hidden_layers", "deepseek": "num_nextn_predict_layers"}
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text",
                       "qwen3_5_mtp")
# attention always gated by a per-head sigmoid (q_proj emits [query, gate]); their configs need not say attn_output_gate
GATED_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5_mtp")
MAX_BLOCK_SIZE = 16  # anchor + up to 15 recursive drafts; acceptance decays fast beyond 3


class MTPOptions(UserModel):
    """``drafter.options`` of the mtp drafter (unknown keys are errors)."""

    layout: Literal["auto", "qwen", "deepseek"] = Field("auto", description="checkpoint layout; auto = detect from tensor names and config.json")
    hidden_tap: Tap | None = Field(None, description="target hidden feeding step 1; unset = family default")
    recycle_hidden: Tap | None = Field(None, description="MTP hidden fed to steps >= 2; unset = family default")
    norm_shifted: bool | None = Field(None, description="qwen layout: +1 already baked into the norms; unset = detect")
    sample_drafts: bool = Field(False, description="at temperature > 0, sample drafts and record dense q")


@dataclass
class MoESpec:
    """A mixture-of-experts MLP: router, routed experts and shared expert(s)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    scoring: Literal["softmax", "sigmoid"]  # qwen: softmax; deepseek: sigmoid + correction bias
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1  # deepseek group-limited routing: keep the best topk_group of n_group groups
    topk_group: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_gate: bool = False  # qwen: shared expert scaled by sigmoid(shared_expert_gate · x)
    shared_name: str = "shared_expert"  # checkpoint spelling: shared_expert (qwen) / shared_experts (deepseek)
    packed: bool = False  # experts stored as gate_up_proj [E, 2I, H] / down_proj [E, H, I]


@dataclass
class MLASpec:
    """DeepSeek multi-head latent attention."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass
class MTPConfig:
    layout: Layout
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    attention_bias: bool
    attn_output_gate: bool
    qk_norm: bool
    norm_offset: float  # 1.0: norms compute x̂·(1 + w); 0.0: x̂·w
    hidden_tap: str
    recycle_hidden: str
    sample_drafts: bool
    weights_path: str
    first_layer: int = 0  # deepseek: num_hidden_layers of the target
    names: dict[str, str] = field(default_factory=dict)  # checkpoint tensor -> module parameter
    # module parameter -> rows of checkpoint tensors: stack over rows of the concatenation of each row
    packed: dict[str, list[list[str]]] = field(default_factory=dict)
    moe: MoESpec | None = None  # None: every MTP block has a dense SwiGLU MLP
    first_k_dense: int = 0  # deepseek: layers below first_k_dense_replace keep a dense MLP
    mla: MLASpec | None = None  # None: q/k/v attention
    rope_interleave: bool = False  # MLA: RoPE rotates interleaved pairs (DeepSeek)
    rope: dict = field(default_factory=lambda: {"rope_type": "default"})  # YaRN parameters when rope_type == "yarn"

    @property
    def shared_projection(self) -> bool:
        """Qwen layout: one fc / pre-fc norms / final norm for all MTP layers."""
        return self.layout == "qwen"

    def is_moe(self, layer: int) -> bool:
        """Whether MTP layer ``layer`` has the mixture-of-experts MLP."""
        return self.moe is not None and self.first_layer + layer >= self.first_k_dense

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(query dim), times DeepSeek's YaRN mscale² for MLA (as transformers applies it)."""
        scale = (self.mla.qk_head_dim if self.mla else self.head_dim) ** -0.5
        if self.mla and self.rope["rope_type"] == "yarn" and self.rope.get("mscale_all_dim"):
            m = yarn_mscale(self.rope["factor"], self.rope["mscale_all_dim"])
            scale *= m * m
        return scale


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(cfg: MTPConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [rope_dim / 2] in float32, factor multiplying cos and sin) for the
    config's RoPE: default, or YaRN (interpolation blended into extrapolation by a linear ramp
    between the beta_fast / beta_slow correction dims; attention factor from mscale)."""
    dim, base = cfg.rope_dim, cfg.rope_theta
    extrapolation = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    r = cfg.rope
    if r["rope_type"] != "yarn":
        return extrapolation.astype(np.float32), 1.0
    factor = float(r["factor"])
    attention = r.get("attention_factor")
    if attention is None:
        mscale, mscale_all = r.get("mscale"), r.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all else yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(r["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(r.get("beta_fast") or 32), correction_dim(r.get("beta_slow") or 1)
    if r.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (high frequencies), 0: interpolate by the factor
    inv = extrapolation / factor * (1.0 - keep) + extrapolation * keep
    return inv.astype(np.float32), float(attention)
