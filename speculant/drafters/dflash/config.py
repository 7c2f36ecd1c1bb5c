"""DFlash / DFlash2 checkpoint config: read config.json, apply the published lookup rules.

Lookup: ``dflash_config.<key>`` first, then the top-level key, then the default. The strict
rule (the reference MLX loader's) takes DFlash keys from ``dflash_config`` only. A Muse Glimmer
assistant (``model_type: muse_glimmer_assistant``) is read through :mod:`.muse_glimmer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculant.core.checkpoint import compare_inventory, float_dtype_problems, read_json_object, tensor_inventory
from speculant.core.errors import CheckpointError, ConfigError
from speculant.core.problems import Problem
from speculant.drafters.dflash import muse_glimmer

DFLASH_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "input_embedding_scale",
               "output_multiplier", "final_logit_softcapping")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlashConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None
    rms_norm_eps: float
    max_position_embeddings: int | None
    num_target_layers: int | None  # None: the checkpoint does not say (a Muse Glimmer assistant)
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int
    layer_types: list[str]
    sliding_window: int | None
    is_causal: bool | None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta, and scaling parameters
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    layout: str = "dflash"  # or muse_glimmer.MODEL_TYPE: tensor names, embedding rows without embed_norm
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def is_muse_glimmer(self) -> bool:
        return self.layout == muse_glimmer.MODEL_TYPE

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def layer_is_causal(self, i: int) -> bool:
        """Published rule: ``is_causal`` applies to all layers; absent, sliding layers are causal."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published fallback: the middle layer for one draft layer, else evenly 1..N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _lookup(raw: dict, key: str, default: Any, strict: bool) -> Any:
    nested = raw.get("dflash_config") or {}
    if key in nested:
        return nested[key]
    if strict and key not in ("block_size", "final_logit_softcapping"):
        return default
    return raw.get(key, default)


def rope_settings(raw: dict) -> dict:
    """rope_type/rope_theta/scaling from ``rope_parameters`` or ``rope_theta`` + ``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict):
        params.update(scaling)
        params.setdefault("rope_type", scaling.get("type", "default"))
    if "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    params.setdefault("rope_theta", 10000.0)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def parse_config(path: str | Path, strict: bool = False) -> tuple[DFlashConfig | None, list[Problem]]:
    """Parse a DFlash/DFlash2 draft folder's config.json; every problem names its key."""
    path = Path(path)
    where = "drafter.path"
    file = path / "config.json"
    if not file.is_file():
        return None, [Problem(where, f"{path} has no config.json", "point drafter.path at a DFlash draft folder")]
    try:
        raw = read_json_object(file)
    except ConfigError as exc:
        return None, [Problem(where, str(exc), "fix or re-download the draft's config.json")]
    problems: list[Problem] = []
    layout = "dflash"
    if muse_glimmer.is_assistant(raw):
        layout = muse_glimmer.MODEL_TYPE
        problems += muse_glimmer.config_problems(raw)
        raw = muse_glimmer.dflash_raw(raw)

    def need(key: str, kind=int, dflash_key: bool = False):
        value = _lookup(raw, key, None, strict) if dflash_key else raw.get(key)
        if value is None or (kind is int and not isinstance(value, int)) or isinstance(value, bool) and kind is int:
            scope = "dflash_config." if (dflash_key and strict) else ""
            problems.append(Problem(f"{where} ({scope}{key})", f"config.json lacks a valid {scope}{key}",
                                    f"add {key} to the draft's config.json"))
            return None
        return value

    arches = raw.get("architectures") or []
    arch = next((a for a in arches if a in ("DFlashDraftModel", "DFlash2DraftModel")), None)
    if arch is None:
        problems.append(Problem(f"{where} (architectures)", f"architectures {arches} names no DFlash draft",
                                "use a DFlashDraftModel / DFlash2DraftModel checkpoint"))
        arch = "DFlashDraftModel"
    hidden = need("hidden_size")
    layers = need("num_hidden_layers")
    heads = need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or (hidden // heads if hidden and heads else None)
    inter = need("intermediate_size")
    num_target_layers = None if layout == muse_glimmer.MODEL_TYPE else need("num_target_layers")
    mask = need("mask_token_id", dflash_key=True)
    layer_ids = _lookup(raw, "target_layer_ids", None, strict)
    if layer_ids is None and not strict and num_target_layers and layers:
        layer_ids = default_target_layer_ids(num_target_layers, layers)
    if not (isinstance(layer_ids, list) and layer_ids and all(isinstance(i, int) for i in layer_ids)):
        problems.append(Problem(f"{where} (dflash_config.target_layer_ids)", "missing or not a list of integers",
                                "add dflash_config.target_layer_ids to the draft's config.json"))
        layer_ids = None
    block = _lookup(raw, "block_size", 16 if not strict else None, strict)
    if not isinstance(block, int) or block < 2:
        problems.append(Problem(f"{where} (block_size)", f"block_size {block!r} is missing or below 2", "set dflash_config.block_size"))
        block = None
    layer_types = raw.get("layer_types") or (["full_attention"] * (layers or 0))
    if layers is not None and len(layer_types) != layers:
        problems.append(Problem(f"{where} (layer_types)", f"{len(layer_types)} entries for {layers} layers", "give one layer type per draft layer"))
    bad_types = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if bad_types:
        problems.append(Problem(f"{where} (layer_types)", f"unknown layer types {bad_types}", "use full_attention or sliding_attention"))
    window = raw.get("sliding_window")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 1):
        problems.append(Problem(f"{where} (sliding_window)", "sliding layers need an integer sliding_window > 1", "set sliding_window"))
    extras = {}
    if arch == "DFlash2DraftModel":
        for key in DFLASH2_KEYS:
            extras[key] = need(key, dflash_key=True)
        if raw.get("is_causal", None) is not False:
            problems.append(Problem(f"{where} (is_causal)", f"DFlash2 drafts must set is_causal: false, found {raw.get('is_causal')!r}",
                                    "set is_causal to false"))
        if hidden and extras.get("conv_group_size") and hidden % extras["conv_group_size"]:
            problems.append(Problem(f"{where} (dflash_config.conv_group_size)",
                                    f"{extras['conv_group_size']} does not divide hidden_size {hidden}", "use a divisor of hidden_size"))
    if problems:
        return None, problems
    softcap = _lookup(raw, "final_logit_softcapping", None, strict)
    config = DFlashConfig(
        architecture=arch,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=raw.get("vocab_size"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings"),
        num_target_layers=num_target_layers,
        target_layer_ids=list(layer_ids),
        mask_token_id=mask,
        block_size=block,
        layer_types=list(layer_types),
        sliding_window=window if "sliding_attention" in layer_types else None,
        is_causal=raw.get("is_causal"),
        attention_bias=bool(raw.get("attention_bias", False)),
        input_embedding_scale=float(_lookup(raw, "input_embedding_scale", 1.0, strict)),
        output_multiplier=float(_lookup(raw, "output_multiplier", 1.0, strict)),
        final_logit_softcapping=float(softcap) if softcap else None,
        rope=rope_settings(raw),
        layout=layout,
        raw=raw,
        **{k: v for k, v in extras.items() if v is not None},
    )
    return config, []


def expected_tensors(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the published on-disk layout."""
    H, hd, nh, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    out = {"fc.weight": (H, len(cfg.target_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H),
            p + "self_attn.k_proj.weight": (nkv * hd, H),
            p + "self_attn.v_proj.weight": (nkv * hd, H),
            p + "self_attn.o_proj.weight": (H, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, H),
            p + "mlp.up_proj.weight": (inter, H),
            p + "mlp.down_proj.weight": (H, inter),
        })
        if cfg.attention_bias:
            out.update({p + "self_attn.q_proj.bias": (nh * hd,), p + "self_attn.k_proj.bias": (nkv * hd,),
                        p + "self_attn.v_proj.bias": (nkv * hd,), p + "self_attn.o_proj.bias": (H,)})
    return out


def check_tensors(path: str | Path, cfg: DFlashConfig, expected: dict[str, tuple[int, ...]] | None = None) -> list[Problem]:
    """Compare the safetensors headers (no weights read) with the published layout."""
    try:
        found = tensor_inventory(path)
    except CheckpointError as exc:
        return [Problem("drafter.path", str(exc), "re-download or re-save the draft weights")]
    if not found:
        return [Problem("drafter.path", f"{path} holds no *.safetensors weights", "point drafter.path at the draft folder")]
    problems = []
    for name in ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight"):
        if name in found:
            problems.append(Problem("drafter.path", f"the draft holds its own {name}; DFlash drafts borrow the target's embedding and LM head",
                                    "use a draft saved in the published layout (no embedding or head)"))
            found = {k: v for k, v in found.items() if k != name}
    for message in compare_inventory(found, expected or expected_tensors(cfg)):
        problems.append(Problem("drafter.path", message, "use a checkpoint saved in the published DFlash layout"))
    for message in float_dtype_problems(path):
        problems.append(Problem("drafter.path", f"{path}: {message}", "re-download or re-save the draft weights"))
    return problems


def describe_problems_to_error(problems: list[Problem]) -> CheckpointError:
    return CheckpointError("; ".join(str(p) for p in problems))


def published_config(
    target: dict,
    mask_token_id: int,
    target_layer_ids: list[int],
    num_layers: int,
    block_size: int,
    sliding_window: int | None = None,
    architecture: str = "DFlashDraftModel",
    extra_dflash: dict | None = None,
    is_causal: bool | None = None,
) -> dict:
    """A draft ``config.json`` in the published layout for a target's ``config.json``: the
    target's attention/MLP shapes and RoPE, the DFlash keys under ``dflash_config``. ``is_causal``
    is written when given (absent, the published rule makes sliding layers causal)."""
    layer_type = "sliding_attention" if sliding_window else "full_attention"
    rope = {k: target[k] for k in ("rope_theta", "rope_scaling", "rope_parameters") if k in target}
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": list(target_layer_ids), **(extra_dflash or {})},
        "dtype": "float32",
        "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "layer_types": [layer_type] * num_layers,
        "max_position_embeddings": target.get("max_position_embeddings"),
        "num_attention_heads": target["num_attention_heads"],
        "num_hidden_layers": num_layers,
        "num_key_value_heads": target.get("num_key_value_heads", target["num_attention_heads"]),
        "num_target_layers": target["num_hidden_layers"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        **rope,
        "sliding_window": sliding_window,
        "use_sliding_window": bool(sliding_window),
        "tie_word_embeddings": False,
        "vocab_size": target["vocab_size"],
        **({} if is_causal is None else {"is_causal": is_causal}),
    }
