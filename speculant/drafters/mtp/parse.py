"""Read an MTP checkpoint's config and headers into an :class:`MTPConfig`, with every problem
found (layout, layer count, unsupported features, tensor shapes), before any weights load."""

from __future__ import annotations

from pathlib import Path

from speculant.core.checkpoint import (
    compare_inventory, float_dtype_problems, read_json_object, safetensors_files, tensor_inventory,
)
from speculant.core.errors import CheckpointError, ConfigError
from speculant.core.types import TargetInfo
from speculant.core.problems import Problem
from speculant.core.validator import text_config

from speculant.drafters.mtp.config import (
    COUNT_KEYS, FAMILY_DEFAULTS, GATED_MODEL_TYPES, QK_NORM_MODEL_TYPES, Layout, MLASpec, MoESpec, MTPConfig, MTPOptions,
)
from speculant.drafters.mtp.tensors import expected_tensors, mtp_names, safetensors_format


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
    rope = rope_settings(cfg)
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


def rope_settings(cfg: dict) -> dict:
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
        try:
            own_raw = read_json_object(folder / "config.json")
        except ConfigError as exc:
            return None, [Problem(where, f"{folder} has no readable config.json ({exc})",
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
    rope = rope_settings(cfg)
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
    for message in float_dtype_problems(folder, set(expected) & set(own)):
        problems.append(Problem(where, f"{folder}: {message}", "re-download or re-save the MTP weights"))
    if note is not None:
        problems.append(note)
    return config, problems


def _header_names(file: Path) -> list[str]:
    from speculant.core.checkpoint import read_safetensors_header

    try:
        return list(read_safetensors_header(file))
    except CheckpointError:
        return []
