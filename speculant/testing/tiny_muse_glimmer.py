"""A tiny random Muse Glimmer target and its DFlash assistant, saved as published.

The target comes from :func:`speculant.testing.tiny_families.build_tiny_family` (the composite
``muse_glimmer`` checkpoint). The assistant is transformers' own ``MuseGlimmerAssistantModel``
with a tiny config matched to it (hidden size, target layers, the tokenizer's mask token, a
small sliding window), random weights, written with ``save_pretrained``: config.json with
``model_type: muse_glimmer_assistant`` and ``encoder.fc`` / ``encoder.output_norm_enc`` /
``layers.*`` / ``norm`` tensors, no embedding and no LM head (it borrows the target's).
"""

from __future__ import annotations

import json
from pathlib import Path

from speculant.testing.tiny import MASK_TOKEN, plant_bias
from speculant.testing.tiny_families import build_tiny_family

# one full-attention layer between sliding ones: both mask kinds are exercised
LAYER_TYPES = ("sliding_attention", "full_attention", "sliding_attention")


def build_tiny_muse_glimmer_target(path: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 4,
                                   sliding_window: int = 16, planted: float = 0.0) -> Path:
    """The composite Muse Glimmer target (float32 safetensors and a tokenizer). ``planted``
    adds :func:`speculant.testing.tiny.plant_bias` (a shared embedding direction, one head row
    along it), so that an assistant reading the same embedding rows and head gets drafts accepted."""
    path = build_tiny_family(path, "muse_glimmer", seed=seed, hidden_size=hidden_size, num_layers=num_layers,
                             sliding_window=sliding_window)
    if planted:
        import torch
        from transformers import MuseGlimmerForConditionalGeneration

        model = MuseGlimmerForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
        with torch.no_grad():
            plant_bias(model, planted, None, seed)
        model.save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_muse_glimmer_assistant(
    path: str | Path,
    target_path: str | Path,
    seed: int = 1,
    target_layer_ids: list[int] | None = None,
    layer_types: tuple[str, ...] = LAYER_TYPES,
    sliding_window: int = 8,
    block_size: int = 16,
    scale: float = 4.0,
) -> Path:
    """Save a random ``muse_glimmer_assistant`` for the target at ``target_path``."""
    import torch
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    path = Path(path)
    text = json.loads((Path(target_path) / "config.json").read_text())["text_config"]
    tokenizer = json.loads((Path(target_path) / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == MASK_TOKEN)
    layers = text["num_hidden_layers"]
    config = MuseGlimmerAssistantConfig(
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=len(layer_types),
        num_attention_heads=text["num_attention_heads"],
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=text["head_dim"],
        rms_norm_eps=text["rms_norm_eps"],
        max_position_embeddings=text["max_position_embeddings"],
        sliding_window=sliding_window,
        layer_types=list(layer_types),
        block_size=block_size,
        mask_token_id=mask_id,
        target_layer_ids=list(target_layer_ids or range(1, layers - 1)),
        bos_token_id=None,
        eos_token_id=text.get("eos_token_id"),
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * scale)
            else:  # norms away from 1, so a norm mapped to the wrong tensor shows
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_muse_glimmer_pair(root: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 4,
                                 sliding_window: int = 16, assistant_window: int = 8,
                                 planted: float = 0.0) -> tuple[Path, Path]:
    """``(target, assistant)`` folders under ``root``."""
    root = Path(root)
    target = build_tiny_muse_glimmer_target(root / "target", seed=seed, hidden_size=hidden_size,
                                            num_layers=num_layers, sliding_window=sliding_window, planted=planted)
    assistant = build_tiny_muse_glimmer_assistant(root / "assistant", target, seed=seed + 1,
                                                  sliding_window=assistant_window)
    return target, assistant
