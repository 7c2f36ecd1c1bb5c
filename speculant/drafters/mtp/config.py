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

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from speculant.core.checkpoint import compare_inventory, safetensors_files, tensor_inventory
from speculant.core.errors import CheckpointError
from speculant.core.types import TargetInfo
from speculant.core.problems import Problem
from speculant.core.validator import text_config

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


class MTPOptions(BaseModel):
    """``drafter.options`` of the mtp drafter (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")

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


def assemble(raw: dict, cfg: MTPConfig, stack, concatenate) -> dict:
    """Module parameters from checkpoint tensors ``raw``: renamed ones and packed ones (per-expert
    tensors stacked into [E, ...], gate and up concatenated), with the backend's array functions."""
    state = {cfg.names[name]: value for name, value in raw.items() if name in cfg.names}
    for param, rows in cfg.packed.items():
        if all(name in raw for row in rows for name in row):
            state[param] = stack([concatenate([raw[name] for name in row]) if len(row) > 1 else raw[row[0]] for row in rows])
    return state


def wanted_tensors(cfg: MTPConfig) -> set[str]:
    """Every checkpoint tensor the loader reads."""
    return set(cfg.names) | {name for rows in cfg.packed.values() for row in rows for name in row}


def _read_json(file: Path) -> dict | None:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def safetensors_format(file: str | Path) -> str | None:
    """The ``format`` entry of a safetensors file's ``__metadata__`` (``pt``, ``mlx``...)."""
    try:
        with Path(file).open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100_000_000:
                return None
            header = json.loads(fh.read(size))
    except (OSError, ValueError, struct.error):
        return None
    meta = header.get("__metadata__") or {}
    return meta.get("format")


def mtp_names(inventory: dict, layout: Layout, first_layer: int) -> dict:
    """The tensors of ``inventory`` that belong to the MTP layers of ``layout``."""
    if layout == "qwen":
        return {k: v for k, v in inventory.items() if k.startswith("mtp.")}
    out = {}
    for name, meta in inventory.items():
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= first_layer:
            out[name] = meta
    return out


def attention_tensors(cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    a = "self_attn."
    if cfg.mla is not None:
        m = cfg.mla
        out = {a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, H),
               a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
               a + "kv_b_proj.weight": (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
               a + "o_proj.weight": (H, nh * m.v_head_dim)}
        if m.q_lora_rank is None:
            out[a + "q_proj.weight"] = (nh * m.qk_head_dim, H)
        else:
            out.update({a + "q_a_proj.weight": (m.q_lora_rank, H), a + "q_a_layernorm.weight": (m.q_lora_rank,),
                        a + "q_b_proj.weight": (nh * m.qk_head_dim, m.q_lora_rank)})
        if cfg.attention_bias:
            out[a + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
            out[a + "o_proj.bias"] = (H,)
            if m.q_lora_rank is not None:
                out[a + "q_a_proj.bias"] = (m.q_lora_rank,)
        return out
    q_rows = nh * hd * (2 if cfg.attn_output_gate else 1)
    out = {a + "q_proj.weight": (q_rows, H), a + "k_proj.weight": (nkv * hd, H),
           a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd)}
    if cfg.qk_norm:
        out[a + "q_norm.weight"] = (hd,)
        out[a + "k_norm.weight"] = (hd,)
    if cfg.attention_bias:
        out.update({a + "q_proj.bias": (q_rows,), a + "k_proj.bias": (nkv * hd,),
                    a + "v_proj.bias": (nkv * hd,), a + "o_proj.bias": (H,)})
    return out


def swiglu_tensors(prefix: str, H: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, H), prefix + "up_proj.weight": (inter, H), prefix + "down_proj.weight": (H, inter)}


def block_tensors(cfg: MTPConfig, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, list[list[str]]]]:
    """One decoder block, names relative to the block: (checkpoint tensor -> shape, checkpoint
    tensor -> module parameter for the tensors loaded as they are, module parameter -> rows of
    checkpoint tensors for the per-expert tensors that are stacked)."""
    H = cfg.hidden_size
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,), **attention_tensors(cfg)}
    packed: dict[str, list[list[str]]] = {}
    renames: dict[str, str] = {}
    if not cfg.is_moe(layer):
        shapes.update(swiglu_tensors("mlp.", H, cfg.intermediate_size))
    else:
        m = cfg.moe
        E, inter = m.num_experts, m.intermediate_size
        shapes["mlp.gate.weight"] = (E, H)
        if m.scoring == "sigmoid":
            shapes["mlp.gate.e_score_correction_bias"] = (E,)
        if m.packed:
            shapes["mlp.experts.gate_up_proj"] = (E, 2 * inter, H)
            shapes["mlp.experts.down_proj"] = (E, H, inter)
        else:
            for e in range(E):
                shapes.update(swiglu_tensors(f"mlp.experts.{e}.", H, inter))
            packed["mlp.experts.gate_up_proj"] = [[f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"] for e in range(E)]
            packed["mlp.experts.down_proj"] = [[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)]
        if m.shared_intermediate_size:
            shared = swiglu_tensors(f"mlp.{m.shared_name}.", H, m.shared_intermediate_size)
            shapes.update(shared)
            renames.update({name: "mlp.shared." + name[len(f"mlp.{m.shared_name}."):] for name in shared})
        if m.shared_gate:
            shapes["mlp.shared_expert_gate.weight"] = (1, H)
            renames["mlp.shared_expert_gate.weight"] = "mlp.shared_gate.weight"
    stacked = {name for rows in packed.values() for row in rows for name in row}
    names = {name: renames.get(name, name) for name in shapes if name not in stacked}
    return shapes, names, packed


def expected_tensors(cfg: MTPConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(every tensor of the published layout with its shape, the optional ones), and fills
    ``cfg.names`` / ``cfg.packed`` with how checkpoint tensors become module parameters."""
    H, V = cfg.hidden_size, cfg.vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    names: dict[str, str] = {}
    packed: dict[str, list[list[str]]] = {}

    def add_block(prefix: str, k: int) -> None:
        shapes, renames, stacks = block_tensors(cfg, k)
        expected.update({prefix + name: shape for name, shape in shapes.items()})
        names.update({prefix + name: f"blocks.{k}." + param for name, param in renames.items()})
        packed.update({f"blocks.{k}." + param: [[prefix + n for n in row] for row in rows] for param, rows in stacks.items()})

    if cfg.layout == "qwen":
        heads = {"mtp.fc.weight": ("proj.0.weight", (H, 2 * H)),
                 "mtp.pre_fc_norm_embedding.weight": ("enorm.0.weight", (H,)),
                 "mtp.pre_fc_norm_hidden.weight": ("hnorm.0.weight", (H,)),
                 "mtp.norm.weight": ("norm.0.weight", (H,))}
        for name, (param, shape) in heads.items():
            expected[name], names[name] = shape, param
        for i in range(cfg.num_layers):
            add_block(f"mtp.layers.{i}.", i)
    else:
        for k in range(cfg.num_layers):
            p = f"model.layers.{cfg.first_layer + k}."
            heads = {"eh_proj.weight": (f"proj.{k}.weight", (H, 2 * H)), "enorm.weight": (f"enorm.{k}.weight", (H,)),
                     "hnorm.weight": (f"hnorm.{k}.weight", (H,)), "shared_head.norm.weight": (f"norm.{k}.weight", (H,))}
            for name, (param, shape) in heads.items():
                expected[p + name], names[p + name] = shape, param
            add_block(p, k)
            for copy in ("embed_tokens.weight", "shared_head.head.weight"):  # copies of the target's; ignored
                expected[p + copy] = (V, H)
                optional.add(p + copy)
    cfg.names, cfg.packed = names, packed
    return expected, optional


def _count(cfg: dict, layout: Layout, where: str, problems: list[Problem]) -> int | None:
    key = COUNT_KEYS[layout]
    value = cfg.get(key)
    if value is None and layout == "qwen" and "num_nextn_predict_layers" in cfg:
        key, value = "num_nextn_predict_layers", cfg["num_nextn_predict_layers"]  # qwen3_next configs
    if value is None:
        problems.append(Problem(f"{where} ({key})", f"config.json has no {key}, so the number of MTP layers is unknown",
                                f"add {key} (the number of MTP layers, usually 1) to config.json"))
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(Problem(f"{where} ({key})", f"{key} is {value!r}: this checkpoint declares no MTP layers",
                                f"set {key} to the number of MTP layers, or use a checkpoint that ships MTP weights"))
        return None
    return value


def _detect_layout(inventory: dict, cfg: dict, declared: str) -> Layout | None:
    if declared != "auto":
        return declared  # type: ignore[return-value]
    if any(k.startswith("mtp.") for k in inventory):
        return "qwen"
    n = cfg.get("num_hidden_layers")
    if "num_nextn_predict_layers" in cfg or (isinstance(n, int) and f"model.layers.{n}.eh_proj.weight" in inventory):
        return "deepseek"
    if "mtp_num_hidden_layers" in cfg:
        return "qwen"
    return None


def _unsupported(cfg: dict, own: dict, where: str) -> list[Problem]:
    problems = []
    if cfg.get("mtp_use_dedicated_embeddings"):
        problems.append(Problem(f"{where} (mtp_use_dedicated_embeddings)", "MTP layers with their own embedding are not supported",
                                "use a checkpoint whose MTP shares the target's embedding (mtp_use_dedicated_embeddings: false)"))
    scaled = sorted(k for k in own if k.endswith(".weight_scale_inv"))
    if scaled:
        problems.append(Problem(f"{where} (quantization_config)",
                                f"the MTP weights are FP8 block-quantized ({scaled[0]} and {len(scaled) - 1} more weight_scale_inv "
                                "tensors), which the mtp drafter does not dequantize",
                                "use a BF16 copy of the checkpoint (e.g. converted with DeepSeek's fp8_cast_bf16.py)"))
    rope = _rope(cfg)
    if rope["rope_type"] not in ("default", "yarn"):
        problems.append(Problem(f"{where} (rope_parameters.rope_type)", f"rope_type {rope['rope_type']!r} is not supported by the mtp drafter",
                                "use a target with default or yarn RoPE"))
    elif rope["rope_type"] == "yarn":
        for key in ("factor", "original_max_position_embeddings"):
            if not isinstance(rope.get(key), (int, float)):
                problems.append(Problem(f"{where} (rope_parameters.{key})", f"yarn RoPE without a numeric {key}",
                                        f"add {key} to rope_parameters (rope_scaling) in config.json"))
    if cfg.get("kv_lora_rank"):
        for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not isinstance(cfg.get(key), int):
                problems.append(Problem(f"{where} ({key})", f"MLA attention (kv_lora_rank set) needs {key} in config.json",
                                        "use the target's full config.json"))
    elif cfg.get("q_lora_rank"):
        problems.append(Problem(f"{where} (kv_lora_rank)", "config.json sets q_lora_rank but not kv_lora_rank, so the MLA "
                                "attention cannot be built", "use the target's full config.json"))
    if cfg.get("n_routed_experts"):
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not isinstance(cfg.get(key), int):
                problems.append(Problem(f"{where} ({key})", f"a mixture-of-experts MTP block (n_routed_experts set) needs {key}",
                                        "use the target's full config.json"))
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            problems.append(Problem(f"{where} (scoring_func)", f"DeepSeek routing scoring_func={cfg.get('scoring_func')!r}, "
                                    f"topk_method={cfg.get('topk_method')!r} is not supported (only DeepSeek-V3's sigmoid / noaux_tc)",
                                    "use a DeepSeek-V3-style target"))
        groups, experts = int(cfg.get("n_group") or 1), int(cfg["n_routed_experts"])
        if experts % groups or experts // groups < 2 or int(cfg.get("topk_group") or 1) > groups:
            problems.append(Problem(f"{where} (n_group)", f"n_group={groups} / topk_group={cfg.get('topk_group')} do not split "
                                    f"{experts} routed experts into groups of at least 2", "use the target's own config.json"))
    elif cfg.get("num_experts"):
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if not isinstance(cfg.get(key), int):
                problems.append(Problem(f"{where} ({key})", f"a mixture-of-experts MTP block (num_experts set) needs {key}",
                                        "use the target's full config.json"))
    return problems


def _rope(cfg: dict) -> dict:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        params.update(scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope" or params.get("mrope_section"):
        rope_type = "default"  # text-only: every M-RoPE section carries the same position
    out = {k: params[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                   "mscale_all_dim", "attention_factor", "truncate") if params.get(k) is not None}
    if rope_type == "yarn" and "factor" not in out and cfg.get("max_position_embeddings") and out.get("original_max_position_embeddings"):
        out["factor"] = cfg["max_position_embeddings"] / out["original_max_position_embeddings"]  # as transformers
    out.update({
        "rope_type": rope_type,
        "rope_theta": float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0),
        "partial_rotary_factor": float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
    })
    return out


def _moe(cfg: dict, own: dict, layout: Layout) -> MoESpec | None:
    packed = any(k.endswith("mlp.experts.gate_up_proj") for k in own)
    if layout == "deepseek" and cfg.get("n_routed_experts"):
        shared = int(cfg.get("n_shared_experts") or 0) * cfg["moe_intermediate_size"]
        return MoESpec(num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                       intermediate_size=int(cfg["moe_intermediate_size"]), scoring="sigmoid",
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                       routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                       n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
                       shared_intermediate_size=shared, shared_name="shared_experts", packed=packed)
    if layout == "qwen" and cfg.get("num_experts"):
        return MoESpec(num_experts=int(cfg["num_experts"]), top_k=int(cfg["num_experts_per_tok"]),
                       intermediate_size=int(cfg["moe_intermediate_size"]), scoring="softmax",
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                       shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                       shared_gate=bool(cfg.get("shared_expert_intermediate_size")), packed=packed)
    return None


def _mla(cfg: dict) -> MLASpec | None:
    if not cfg.get("kv_lora_rank"):
        return None
    return MLASpec(q_lora_rank=cfg.get("q_lora_rank") or None, kv_lora_rank=int(cfg["kv_lora_rank"]),
                   qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
                   v_head_dim=int(cfg["v_head_dim"]))


def _shifted(folder: Path, inventory_files: list[Path], declared: bool | None, raw: dict) -> tuple[bool, str]:
    """Whether a qwen-layout folder already has the +1 baked into its norms, and why."""
    if declared is not None:
        return declared, "declared by drafter.options.norm_shifted"
    if raw.get("model_type", "").endswith("_mtp"):
        return True, f"config.json model_type {raw['model_type']!r} marks an MLX-converted MTP folder"
    if any(safetensors_format(f) == "mlx" for f in inventory_files):
        return True, "its safetensors were saved by MLX (metadata format=mlx), whose converters add the +1"
    return False, "raw Hugging Face weights"


def parse_mtp(folder: Path, target: TargetInfo, options: MTPOptions, separate: bool) -> tuple[MTPConfig | None, list[Problem]]:
    """Read config.json and the tensor headers of ``folder``; return the config and every problem."""
    where = "drafter.path" if separate else "target.path"
    problems: list[Problem] = []
    raw = target.raw
    if separate:
        own_raw = _read_json(folder / "config.json")
        if own_raw is None:
            return None, [Problem(where, f"{folder} has no readable config.json",
                                  "give the MTP folder a config.json with mtp_num_hidden_layers or num_nextn_predict_layers")]
        raw = {**text_config(raw), **text_config(own_raw)}
        folder_raw = own_raw
    else:
        folder_raw = raw
    cfg = text_config(raw)
    try:
        inventory = tensor_inventory(folder)
    except CheckpointError as exc:
        return None, [Problem(where, str(exc), "re-download or re-save the weights")]
    layout = _detect_layout(inventory, cfg, options.layout)
    if layout is None:
        return None, [Problem(where, f"{folder} holds no MTP weights: no mtp.* tensors and no num_nextn_predict_layers / "
                                     "mtp_num_hidden_layers in config.json",
                              "use a checkpoint that ships MTP layers, or point drafter.path at the MTP weights")]
    count = _count(cfg, layout, where, problems)
    first_layer = int(cfg.get("num_hidden_layers") or 0)
    own = mtp_names(inventory, layout, first_layer)
    problems += _unsupported(cfg, own, where)
    heads = cfg.get("num_attention_heads")
    H = cfg.get("hidden_size")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if not isinstance(cfg.get(k), int)]
    if missing:
        problems.append(Problem(where, f"config.json lacks {', '.join(missing)}", "use the target's full config.json"))
    if problems or count is None:
        return None, problems
    defaults = FAMILY_DEFAULTS[layout]
    offset = defaults["norm_offset"]
    note = None
    if layout == "qwen":
        files = [f for f in safetensors_files(folder) if any(n.startswith("mtp.") for n in _header_names(f))]
        shifted, why = _shifted(folder, files, options.norm_shifted, folder_raw)
        offset = 0.0 if shifted else 1.0
        if shifted and options.norm_shifted is None:
            note = Problem(where, f"MTP norms taken as pre-shifted (x̂·w, no +1): {why}",
                           "set drafter.options.norm_shifted = false if this folder holds raw Hugging Face weights",
                           severity="warning")
    rope = _rope(cfg)
    model_type = str(cfg.get("model_type", ""))
    config = MTPConfig(
        layout=layout,
        num_layers=count,
        hidden_size=H,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or H // heads),
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        attention_bias=bool(cfg.get("attention_bias", False)),
        attn_output_gate=bool(cfg.get("attn_output_gate", model_type in GATED_MODEL_TYPES)),
        qk_norm=layout == "qwen" or model_type in QK_NORM_MODEL_TYPES or bool(cfg.get("use_qk_norm", False)),
        norm_offset=offset,
        hidden_tap=options.hidden_tap or defaults["hidden_tap"],
        recycle_hidden=options.recycle_hidden or defaults["recycle_hidden"],
        sample_drafts=options.sample_drafts,
        weights_path=str(folder),
        first_layer=first_layer if layout == "deepseek" else 0,
        moe=_moe(cfg, own, layout),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0) if layout == "deepseek" else 0,
        mla=_mla(cfg),
        rope_interleave=bool(cfg.get("rope_interleave", True)) and bool(cfg.get("kv_lora_rank")),
        rope={k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")},
    )
    expected, optional = expected_tensors(config)
    for message in compare_inventory(own, expected, optional):
        problems.append(Problem(where, message, f"use a checkpoint saved in the published {layout} MTP layout"))
    if note is not None:
        problems.append(note)
    return config, problems


def _header_names(file: Path) -> list[str]:
    from speculant.core.checkpoint import read_safetensors_header

    try:
        return list(read_safetensors_header(file))
    except CheckpointError:
        return []
