"""Tiny random targets of the families the published drafts pair with, saved in the on-disk
layout of their published checkpoints (``save_pretrained``, safetensors, plus a tokenizer).

``build_tiny_family(path, family)`` makes one. Families and what they exercise:

- ``llama``: all full attention (the baseline).
- ``qwen3_5`` / ``qwen3_5_moe``: composite config (``text_config``, a tiny vision tower) with
  ``model.language_model.*`` tensors; Gated DeltaNet (``linear_attention``) 3 : 1 full.
- ``qwen3_next``: the same 3 : 1 pattern with MoE, ``rope_theta`` / ``partial_rotary_factor`` at
  the top level of config.json as the Hub configs have them.
- ``gemma3_text``, ``mistral``, ``gpt_oss``, ``muse_glimmer``: sliding-window attention
  (``sliding_window`` small so tests cross it), Muse Glimmer as its composite checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from speculant.testing.tiny import build_tokenizer

FAMILIES = ("llama", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3_text", "mistral", "gpt_oss", "muse_glimmer")
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
SLIDING = ("gemma3_text", "mistral", "gpt_oss", "muse_glimmer")

_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _text(vocab: int, eos: int, hidden: int, layers: int, max_pos: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_pos,
                eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def _config(family: str, text: dict, window: int, layers: int):
    import transformers as t

    pattern = ["full_attention" if (i + 1) % 4 == 0 else None for i in range(layers)]
    if family == "llama":
        return t.LlamaConfig(**text), t.LlamaForCausalLM
    if family in ("qwen3_5", "qwen3_5_moe"):
        linear = [p or "linear_attention" for p in pattern]
        inner = {**text, **_LINEAR, "layer_types": linear, **(_MOE if family == "qwen3_5_moe" else {})}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
        cls = t.Qwen3_5Config if family == "qwen3_5" else t.Qwen3_5MoeConfig
        model_cls = t.Qwen3_5ForConditionalGeneration if family == "qwen3_5" else t.Qwen3_5MoeForConditionalGeneration
        return cls(text_config=inner, vision_config=vision, tie_word_embeddings=False), model_cls
    if family == "qwen3_next":
        linear = [p or "linear_attention" for p in pattern]
        return t.Qwen3NextConfig(**text, **_LINEAR, **_MOE, layer_types=linear), t.Qwen3NextForCausalLM
    sliding = [p or "sliding_attention" for p in pattern]
    if family == "gemma3_text":
        return t.Gemma3TextConfig(**text, sliding_window=window, layer_types=sliding,
                                  query_pre_attn_scalar=16), t.Gemma3ForCausalLM
    if family == "mistral":
        return t.MistralConfig(**text, sliding_window=window), t.MistralForCausalLM
    if family == "gpt_oss":
        alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return t.GptOssConfig(**text, sliding_window=window, layer_types=alternating, num_local_experts=4,
                              num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), \
            t.GptOssForCausalLM
    if family == "muse_glimmer":
        inner = {**text, "sliding_window": window, "layer_types": sliding,
                 "layer_rope_theta": [0 if p == "full_attention" else 10000.0 for p in sliding]}
        vision = getattr(t, "MuseGlimmerVisionConfig", None)
        cfg = t.MuseGlimmerConfig(text_config=inner, **({"vision_config": _tiny_muse_vision()} if vision else {}))
        return cfg, t.MuseGlimmerForConditionalGeneration
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def _tiny_muse_vision() -> dict:
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def build_tiny_family(
    path: str | Path,
    family: str,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 4,
    sliding_window: int = 16,
    max_position_embeddings: int = 512,
    scale: float = 4.0,
) -> Path:
    """Save a random ``family`` target (float32 safetensors) and a tokenizer under ``path``."""
    import torch

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    text = _text(len(tokenizer), tokenizer.eos_token_id, hidden_size, num_layers, max_position_embeddings)
    config, model_cls = _config(family, text, sliding_window, num_layers)
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * scale)
    model.save_pretrained(str(path), safe_serialization=True)
    if family == "qwen3_next":
        _rope_at_top_level(path / "config.json")
    return path


def _rope_at_top_level(file: Path) -> None:
    """Hub Qwen3-Next configs carry ``rope_theta`` / ``partial_rotary_factor`` at the top level."""
    raw = json.loads(file.read_text())
    rope = raw.pop("rope_parameters", None) or {}
    raw["rope_theta"] = rope.get("rope_theta", 10000.0)
    raw["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.25)
    file.write_text(json.dumps(raw, indent=2))
