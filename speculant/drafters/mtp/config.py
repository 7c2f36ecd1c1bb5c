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

The decoder block is the Qwen3-style one (q/k norms for Qwen-family targets, optional
Qwen3-Next output gate, partial rotary, dense SwiGLU MLP). MLA attention and MoE blocks are
reported as unsupported rather than half-loaded.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from speculant.core.checkpoint import compare_inventory, safetensors_files, tensor_inventory
from speculant.core.errors import CheckpointError
from speculant.core.types import TargetInfo
from speculant.core.validator import Problem, text_config

Layout = Literal["qwen", "deepseek"]
Tap = Literal["post_norm", "pre_norm"]

# Per-family defaults (mtp-and-verification.md §1.4): Qwen/GLM feed and recycle post-norm;
# DeepSeek-V3 (as vLLM) feeds post-norm and recycles the state before shared_head.norm.
FAMILY_DEFAULTS: dict[str, dict] = {
    "qwen": {"hidden_tap": "post_norm", "recycle_hidden": "post_norm", "norm_offset": 1.0},
    "deepseek": {"hidden_tap": "post_norm", "recycle_hidden": "pre_norm", "norm_offset": 0.0},
}
COUNT_KEYS = {"qwen": "mtp_num_hidden_layers", "deepseek": "num_nextn_predict_layers"}
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_mtp")
MAX_BLOCK_SIZE = 16  # anchor + up to 15 recursive drafts; acceptance decays fast beyond 3


class MTPOptions(BaseModel):
    """``drafter.options`` of the mtp drafter (unknown keys are errors)."""

    model_config = ConfigDict(extra="forbid")

    layout: Literal["auto", "qwen", "deepseek"] = "auto"
    hidden_tap: Tap | None = None  # target hidden feeding step 1; None = family default
    recycle_hidden: Tap | None = None  # MTP hidden fed to steps >= 2; None = family default
    norm_shifted: bool | None = None  # qwen layout: +1 already baked into the norms; None = detect
    sample_drafts: bool = False  # at temperature > 0, sample drafts and record dense q


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

    @property
    def shared_projection(self) -> bool:
        """Qwen layout: one fc / pre-fc norms / final norm for all MTP layers."""
        return self.layout == "qwen"


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


def block_tensors(prefix: str, cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    H, hd, nh, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    q_rows = nh * hd * (2 if cfg.attn_output_gate else 1)
    out = {
        prefix + "input_layernorm.weight": (H,),
        prefix + "post_attention_layernorm.weight": (H,),
        prefix + "self_attn.q_proj.weight": (q_rows, H),
        prefix + "self_attn.k_proj.weight": (nkv * hd, H),
        prefix + "self_attn.v_proj.weight": (nkv * hd, H),
        prefix + "self_attn.o_proj.weight": (H, nh * hd),
        prefix + "mlp.gate_proj.weight": (inter, H),
        prefix + "mlp.up_proj.weight": (inter, H),
        prefix + "mlp.down_proj.weight": (H, inter),
    }
    if cfg.qk_norm:
        out[prefix + "self_attn.q_norm.weight"] = (hd,)
        out[prefix + "self_attn.k_norm.weight"] = (hd,)
    if cfg.attention_bias:
        out.update({prefix + "self_attn.q_proj.bias": (q_rows,), prefix + "self_attn.k_proj.bias": (nkv * hd,),
                    prefix + "self_attn.v_proj.bias": (nkv * hd,), prefix + "self_attn.o_proj.bias": (H,)})
    return out


def expected_tensors(cfg: MTPConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(every tensor of the published layout with its shape, the optional ones), and fills
    ``cfg.names`` with the checkpoint-name -> module-parameter mapping."""
    H, V = cfg.hidden_size, cfg.vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    names: dict[str, str] = {}
    if cfg.layout == "qwen":
        heads = {"mtp.fc.weight": ("proj.0.weight", (H, 2 * H)),
                 "mtp.pre_fc_norm_embedding.weight": ("enorm.0.weight", (H,)),
                 "mtp.pre_fc_norm_hidden.weight": ("hnorm.0.weight", (H,)),
                 "mtp.norm.weight": ("norm.0.weight", (H,))}
        for name, (param, shape) in heads.items():
            expected[name], names[name] = shape, param
        for i in range(cfg.num_layers):
            for name, shape in block_tensors(f"mtp.layers.{i}.", cfg).items():
                expected[name], names[name] = shape, f"blocks.{i}." + name[len(f"mtp.layers.{i}."):]
    else:
        for k in range(cfg.num_layers):
            p = f"model.layers.{cfg.first_layer + k}."
            heads = {"eh_proj.weight": (f"proj.{k}.weight", (H, 2 * H)), "enorm.weight": (f"enorm.{k}.weight", (H,)),
                     "hnorm.weight": (f"hnorm.{k}.weight", (H,)), "shared_head.norm.weight": (f"norm.{k}.weight", (H,))}
            for name, (param, shape) in heads.items():
                expected[p + name], names[p + name] = shape, param
            for name, shape in block_tensors(p, cfg).items():
                expected[name], names[name] = shape, f"blocks.{k}." + name[len(p):]
            for copy in ("embed_tokens.weight", "shared_head.head.weight"):  # copies of the target's; ignored
                expected[p + copy] = (V, H)
                optional.add(p + copy)
    cfg.names = names
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
    if cfg.get("kv_lora_rank") or cfg.get("q_lora_rank"):
        problems.append(Problem(f"{where} (kv_lora_rank)", "MLA attention (DeepSeek-V2/V3 style) is not supported by the mtp drafter",
                                "use a target whose MTP block has standard q/k/v projections"))
    if any(".experts." in k or ".shared_expert" in k or k.endswith("mlp.gate.weight") for k in own):
        problems.append(Problem(where, "the MTP block is a mixture-of-experts layer, which the mtp drafter does not support yet",
                                "use a dense-MLP checkpoint (e.g. the dense Qwen3.5/3.6 models)"))
    if cfg.get("mtp_use_dedicated_embeddings"):
        problems.append(Problem(f"{where} (mtp_use_dedicated_embeddings)", "MTP layers with their own embedding are not supported",
                                "use a checkpoint whose MTP shares the target's embedding (mtp_use_dedicated_embeddings: false)"))
    rope = _rope(cfg)
    if rope["rope_type"] not in ("default", "mrope"):
        problems.append(Problem(f"{where} (rope_parameters.rope_type)", f"rope_type {rope['rope_type']!r} is not supported by the mtp drafter",
                                "use a target with default RoPE"))
    return problems


def _rope(cfg: dict) -> dict:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict):
        params.update(scaling)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope" or params.get("mrope_section"):
        rope_type = "default"  # text-only: every M-RoPE section carries the same position
    return {
        "rope_type": rope_type,
        "rope_theta": float(cfg.get("rope_theta", params.get("rope_theta", 10000.0))),
        "partial_rotary_factor": float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
    }


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
        attn_output_gate=bool(cfg.get("attn_output_gate", False)),
        qk_norm=layout == "qwen" or model_type in QK_NORM_MODEL_TYPES or bool(cfg.get("use_qk_norm", False)),
        norm_offset=offset,
        hidden_tap=options.hidden_tap or defaults["hidden_tap"],
        recycle_hidden=options.recycle_hidden or defaults["recycle_hidden"],
        sample_drafts=options.sample_drafts,
        weights_path=str(folder),
        first_layer=first_layer if layout == "deepseek" else 0,
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
