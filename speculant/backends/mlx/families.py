"""Target families as published, loaded through mlx-lm so that the model does what the config says.

mlx-lm's model classes read the keys their authors' checkpoints had. Folders written by
transformers 5 (what the Hub serves for new uploads, and what ``speculant.testing.tiny_families``
writes) sometimes say the same thing with other keys or tensor layouts. Here:

- :func:`config_overrides`: ``rope_parameters`` as the ``rope_theta`` / ``rope_scaling`` (and
  Gemma 3's ``rope_local_base_freq``) mlx-lm reads; Gemma 3's ``layer_types`` as its
  ``sliding_window_pattern``.
- :func:`model_classes`: tensors mlx-lm's ``sanitize`` does not know: per-expert Qwen3.5-MoE
  weights (stacked), unquantized GPT-OSS experts (``[experts, in, out]``, transposed), Muse
  Glimmer's vision tower under ``model.vision_*`` (dropped).
- :func:`honour_window`: mlx-lm's Llama class (also used for Mistral) reads ``layer_types``
  only, so a Mistral ``sliding_window`` would be ignored; its layers are switched to sliding.
- :func:`check_layers`: what the loaded model caches per layer (its own idea of each layer's
  kind and window) must match the config's ``layer_types`` / ``sliding_window``; otherwise the
  target is refused, naming the family and the key, rather than decoding differently.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from speculant.core.errors import ConfigError
from speculant.core.types import TargetInfo

ROLLED_BACK = ("full_attention", "sliding_attention")
# Families whose Gated DeltaNet module speculant records per position (caches.install_delta_taps).
DELTA_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# Config keys a family's mlx-lm class ignores: a set value there would decode differently.
IGNORED_KEYS = {"gemma3_text": ("final_logit_softcapping", "attn_logit_softcapping")}


class FamilyError(ConfigError):
    """This target family cannot be run (exactly) by the MLX backend."""

    def __init__(self, message: str, field: str | None = "target.path") -> None:
        super().__init__(message, field)


def family(info: TargetInfo) -> str:
    top = info.raw.get("model_type") if isinstance(info.raw, dict) else None
    return str(top or info.model_type)


def rollback_problem(info: TargetInfo) -> str | None:
    kinds = list(dict.fromkeys(info.layer_types))
    bad = [k for k in kinds if k not in ROLLED_BACK]
    if "linear_attention" in bad and (info.model_type in DELTA_FAMILIES or family(info) in DELTA_FAMILIES):
        bad.remove("linear_attention")
    if not bad:
        return None
    return (f"the mlx backend cannot roll back {', '.join(bad)} layers of a {family(info)!r} target after a "
            "rejected block, so it cannot decode it speculatively")


# -- config ------------------------------------------------------------------------------------

def _flat_rope(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters")
    if "rope_theta" in cfg or not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", rope.get("type", "default")) != "default" and cfg.get("rope_scaling") is None:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def _gemma3(cfg: dict) -> dict:
    out: dict[str, Any] = {}
    types = cfg.get("layer_types")
    if isinstance(types, list) and "sliding_window_pattern" not in cfg:
        fulls = [i for i, t in enumerate(types) if t == "full_attention"]
        pattern = fulls[0] + 1 if fulls else len(types) + 1
        if any((t == "full_attention") != ((i + 1) % pattern == 0) for i, t in enumerate(types)):
            raise FamilyError(f"gemma3_text: mlx-lm places full-attention layers every n layers; the layer_types "
                              f"{types} have no such period")
        out["sliding_window_pattern"] = pattern
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in cfg:
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        for key, part in (("rope_theta", full), ("rope_local_base_freq", local)):
            if "rope_theta" in part:
                out[key] = part["rope_theta"]
        if full.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
        if local.get("rope_type", "default") != "default":
            raise FamilyError("gemma3_text: mlx-lm applies no rope scaling to sliding layers "
                              "(rope_parameters.sliding_attention)")
    return out


def config_overrides(raw: dict) -> dict:
    """Keys to add to config.json so mlx-lm's class reads what the config says."""
    if isinstance(raw.get("text_config"), dict):
        return {}  # composite families' mlx-lm classes read their text_config themselves
    if raw.get("model_type") == "gemma3_text":
        return _gemma3(raw)
    return _flat_rope(raw)


def _check_ignored(raw: dict) -> None:
    for key in IGNORED_KEYS.get(str(raw.get("model_type")), ()):
        if raw.get(key) not in (None, False, 0):
            raise FamilyError(f"{raw['model_type']}: mlx-lm's model ignores {key} = {raw[key]!r}; it would decode "
                              "differently from the published model")


# -- weights -----------------------------------------------------------------------------------

def _stack_qwen_experts(weights: dict) -> dict:
    """Per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` as the fused tensors mlx-lm splits."""
    import mlx.core as mx

    groups: dict[str, dict[int, dict[str, Any]]] = {}
    rest = {}
    for key, value in weights.items():
        head, sep, tail = key.partition(".mlp.experts.")
        parts = tail.split(".")
        if sep and len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            groups.setdefault(head, {}).setdefault(int(parts[0]), {})[parts[1]] = value
        else:
            rest[key] = value
    for head, experts in groups.items():
        order = [experts[e] for e in sorted(experts)]
        rest[f"{head}.mlp.experts.gate_up_proj"] = mx.stack(
            [mx.concatenate([e["gate_proj"], e["up_proj"]], axis=0) for e in order])
        rest[f"{head}.mlp.experts.down_proj"] = mx.stack([e["down_proj"] for e in order])
    return rest


def _gpt_oss_experts(weights: dict) -> dict:
    """Unquantized ``experts.gate_up_proj`` / ``down_proj`` are ``[experts, in, out]``; mlx-lm's
    sanitize handles the MXFP4 ``_blocks`` layout ``[experts, out, in]`` only."""
    out = {}
    for key, value in weights.items():
        if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            key, value = key + ".weight", value.swapaxes(-1, -2)
        out[key] = value
    return out


def _drop_vision(weights: dict) -> dict:
    """Muse Glimmer's vision tower saved under ``model.vision_*`` (mlx-lm drops only ``vision_*``)."""
    return {k: v for k, v in weights.items() if not k.startswith("model.vision_")}


_SANITIZE = {"qwen3_5_moe": _stack_qwen_experts, "gpt_oss": _gpt_oss_experts, "muse_glimmer": _drop_vision}


def model_classes(config: dict):
    """mlx-lm's (Model, ModelArgs) for ``config``, with a sanitize step for published layouts it lacks."""
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    fix = _SANITIZE.get(config.get("model_type"))
    if fix is None:
        return model_cls, args_cls

    class Published(model_cls):
        def sanitize(self, weights):
            return super().sanitize(fix(weights))

    Published.__name__ = Published.__qualname__ = model_cls.__name__
    Published.__module__ = model_cls.__module__  # family checks below go by the mlx-lm module
    return Published, args_cls


def family_problem(info: TargetInfo) -> str | None:
    """Why mlx-lm has no model for the target's config.json ``model_type``, or None."""
    from mlx_lm.utils import MODEL_REMAPPING

    from speculant.core.target_check import TESTED_FAMILIES

    model_type = info.raw.get("model_type") if isinstance(info.raw, dict) else None
    name = MODEL_REMAPPING.get(model_type, model_type) if isinstance(model_type, str) else None
    try:
        found = name is not None and importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (f"{Path(info.path) / 'config.json'}: model_type {model_type!r}: mlx-lm has no model for the "
            f"{model_type!r} family, so the mlx backend cannot load it (families speculant is tested on: {', '.join(TESTED_FAMILIES)}; "
            "the torch backend loads any family transformers knows)")


def _require_module(info: TargetInfo) -> None:
    problem = family_problem(info)
    if problem:
        raise FamilyError(problem)


def load(path: str | Path, info: TargetInfo, **kwargs):
    """The mlx-lm model for ``path`` (lazy weights), checked to do what its config says."""
    from mlx_lm.utils import load_config, load_model

    path = Path(path)
    _require_module(info)
    raw = load_config(path)
    _check_ignored(raw)
    model, _ = load_model(path, lazy=True, model_config=config_overrides(raw), get_model_classes=model_classes,
                          **kwargs)
    honour_window(model, info)
    check_layers(model, info)
    return model


# -- what the loaded model does per layer --------------------------------------------------------

def honour_window(model, info: TargetInfo) -> None:
    """mlx-lm's Llama (Mistral's class too) reads only ``layer_types``: give its layers the config's."""
    inner = getattr(model, "model", None)
    if type(model).__module__ != "mlx_lm.models.llama" or inner is None or info.sliding_window is None:
        return
    if len(info.layer_types) != len(inner.layers) or list(inner.layer_types) == list(info.layer_types):
        return
    for layer, kind in zip(inner.layers, info.layer_types):
        layer.use_sliding = kind == "sliding_attention"
    inner.layer_types = list(info.layer_types)
    inner.sliding_window = info.sliding_window
    inner.swa_idx = next((i for i, k in enumerate(info.layer_types) if k == "sliding_attention"), None)
    inner.fa_idx = next((i for i, k in enumerate(info.layer_types) if k == "full_attention"), 0)


def model_layer_kinds(model) -> list[tuple[str, int | None]]:
    """Each layer's kind (and window) as the loaded model caches it."""
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

    kinds = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            kinds.append(("sliding_attention", c.max_size))
        elif type(c) is ArraysCache:
            kinds.append(("linear_attention", None))
        elif type(c) is KVCache:
            kinds.append(("full_attention", None))
        else:
            kinds.append((type(c).__name__, None))
    return kinds


def check_layers(model, info: TargetInfo) -> None:
    if not info.layer_types:
        return
    got = model_layer_kinds(model)
    name = family(info)
    if len(got) != len(info.layer_types):
        raise FamilyError(f"{name}: mlx-lm's model has {len(got)} layers, the config's layer_types "
                          f"{len(info.layer_types)}")
    for i, ((kind, window), want) in enumerate(zip(got, info.layer_types)):
        if kind != want:
            raise FamilyError(f"{name}: mlx-lm's model treats layer {i} as {kind} but the config's layer_types says "
                              f"{want}; it would decode differently from the published model")
        if kind == "sliding_attention" and window != info.sliding_window:
            raise FamilyError(f"{name}: mlx-lm's model gives layer {i} a window of {window} but the config's "
                              f"sliding_window is {info.sliding_window}")


# -- what drafters sharing the target's embedding and head must see -------------------------------

def embed_transform(model, inner):
    """What the family's forward does to the embedding table's rows before its first layer (None:
    nothing), as transformers' embedding module does: Gemma's sqrt(hidden) (Gemma 3's rounded to
    bfloat16), Muse Glimmer's weightless RMSNorm."""
    import mlx.core as mx

    module = type(model).__module__
    if module == "mlx_lm.models.gemma3_text":
        scale = mx.array(model.args.hidden_size ** 0.5, mx.bfloat16)
    elif module == "mlx_lm.models.muse_glimmer":
        eps = inner.embed_eps
        return lambda rows: mx.fast.rms_norm(rows, None, eps)
    else:
        scale = getattr(inner, "embed_scale", None)
    return None if scale is None else (lambda rows: rows * scale)


def logit_transform(model):
    """What the family's forward does to ``lm_head`` outputs (None: nothing), in the same order."""
    if type(model).__module__ == "mlx_lm.models.muse_glimmer":
        import mlx.core as mx

        multiplier, cap = model.args.output_multiplier, model.args.final_logit_softcapping
        return lambda x: mx.tanh((x * multiplier) / cap) * cap
    return None
