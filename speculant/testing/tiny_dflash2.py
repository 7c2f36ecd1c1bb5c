"""Tiny DFlash2 drafts in the published on-disk layout, for tests and benchmarks.

The DFlash v1 part is written by :func:`speculant.testing.tiny.build_tiny_dflash` with the same
seed, so a DFlash2 draft and a DFlash draft built with equal arguments share every v1 tensor.
The config follows the published ``z-lab/Qwen3.8-27B-DFlash2`` file: ``is_causal: false``,
sliding-attention layers, ``rope_parameters``, and every DFlash key (``block_size`` included)
inside ``dflash_config``. The codebooks are stored without a ``.weight`` suffix unless asked.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from speculant.testing.tiny import build_tiny_dflash

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def build_tiny_dflash2(
    path: str | Path,
    target_path: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    sliding_window: int = 2048,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 16,
    selector_top_k: int = 8,
    identity: bool = False,
    conv_scale: float = 0.3,
    codebook_scale: float = 1.0,
    codebook_suffix: str = "",
    output_multiplier: float | None = None,
    scale: float = 1.0,
    extra_config: dict | None = None,
) -> Path:
    """Save a random DFlash2 draft (config.json + model.safetensors) for ``target_path``.

    ``identity``: the published training initialisation (tap 0 = 1, tap 1 = 0, zero kernel
    projection, zero successor codebook), under which DFlash2 proposes exactly what DFlash
    does. Otherwise the taps get ``conv_scale`` noise and the codebooks ``codebook_scale``.
    ``codebook_suffix=".weight"`` writes the converted-checkpoint spelling.
    ``output_multiplier`` (a published optional key) scales the unary logits; small values
    let the selector's bilinear scores change the chosen path.
    """
    from safetensors.numpy import load_file, save_file

    path = Path(path)
    build_tiny_dflash(path, target_path, seed=seed, num_layers=num_layers, block_size=block_size,
                      target_layer_ids=target_layer_ids, sliding_window=sliding_window, scale=scale)
    tensors = load_file(str(path / "model.safetensors"))
    v1 = json.loads((path / "config.json").read_text())
    H, V = v1["hidden_size"], v1["vocab_size"]
    groups = H // conv_group_size
    rng = np.random.default_rng(seed + 1000)

    def normal(*shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = np.zeros((2, conv_kernel_size, H), np.float32)
            base[:, 0] = 1.0
            projection = np.zeros((2 * conv_kernel_size * groups, H), np.float32)
            if not identity:
                base += normal(2, conv_kernel_size, H, std=conv_scale)
                projection = normal(2 * conv_kernel_size * groups, H, std=conv_scale / np.sqrt(H))
            tensors[f"layers.{i}.{conv}.base_kernel"] = base
            tensors[f"layers.{i}.{conv}.kernel_projection.weight"] = projection
    tensors["candidate_selector.hidden_projection.weight"] = normal(selector_rank, H, std=1.0 / np.sqrt(H))
    predecessor = normal(V, selector_rank, std=codebook_scale)
    successor = np.zeros((V, selector_rank), np.float32) if identity else normal(V, selector_rank, std=codebook_scale)
    tensors[CODEBOOKS[0] + codebook_suffix] = predecessor
    tensors[CODEBOOKS[1] + codebook_suffix] = successor
    keys = {"conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
            "selector_rank": selector_rank, "selector_top_k": selector_top_k}
    if output_multiplier is not None:
        keys["output_multiplier"] = output_multiplier
    config = dflash2_config(v1, block_size, sliding_window, keys, extra_config)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def dflash2_config(v1: dict, block_size: int, sliding_window: int, keys: dict, extra: dict | None = None) -> dict:
    """The published DFlash2 config.json layout, from a tiny DFlash v1 config."""
    config = {k: v for k, v in v1.items() if k not in ("block_size", "rope_theta", "rope_scaling", "dflash_config")}
    n = v1["num_hidden_layers"]
    config.update({
        "architectures": ["DFlash2DraftModel"],
        "is_causal": False,
        "layer_types": ["sliding_attention"] * n,
        "max_window_layers": n,
        "sliding_window": sliding_window,
        "use_sliding_window": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": v1["rope_theta"]},
        "dflash_config": {"block_size": block_size, **v1["dflash_config"], **keys},
    })
    config.update(extra or {})
    return config


def soften_target(target_path: str | Path, factor: float) -> Path:
    """Scale every residual-writing matrix (``o_proj``, ``down_proj``) of a tiny target by
    ``factor``, so the planted embedding direction survives the random layers and the target
    follows it part of the time (acceptance with rejections, not all-or-nothing)."""
    from safetensors.numpy import load_file, save_file

    file = Path(target_path) / "model.safetensors"
    tensors = load_file(str(file))
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * np.float32(factor)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return Path(target_path)


def build_tiny_dflash2_pair(root: str | Path, seed: int = 0, planted: float = 4.0, soften: float = 0.5,
                            **draft_kwargs) -> tuple[Path, Path]:
    """A planted tiny target and a DFlash2 draft under ``root/target`` and ``root/dflash2``.

    With the defaults, greedy runs mix full-block acceptances, partial ones and rejections.
    """
    from speculant.testing.tiny import build_tiny_target

    root = Path(root)
    target = soften_target(build_tiny_target(root / "target", seed=seed, planted=planted), soften)
    draft = build_tiny_dflash2(root / "dflash2", target, seed=seed + 7, **draft_kwargs)
    return target, draft
