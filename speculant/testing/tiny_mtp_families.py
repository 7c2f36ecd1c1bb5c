"""Tiny mixture-of-experts, MLA and hybrid targets with their MTP layers, for tests: Qwen3-Next,
Qwen3.5 (dense and MoE, optionally with the 3:1 Gated DeltaNet pattern) and DeepSeek-V3, as real
safetensors + config.json written by transformers' own classes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from speculant.testing.tiny_mtp import successor_map, target_config, write_mtp


FAMILY_LAYOUT = {"qwen3_next": "qwen", "qwen3_5": "qwen", "qwen3_5_moe": "qwen", "deepseek_v3": "deepseek"}
QWEN_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def hybrid_layer_types(num_layers: int) -> list[str]:
    """The published Qwen3-Next / Qwen3.5 pattern: three Gated DeltaNet layers, then full attention."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def _qwen_text(family: str, vocab_size: int, eos_token_id: int | None, hybrid: bool, overrides: dict) -> dict:
    args = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4 if hybrid else 2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, tie_word_embeddings=False, eos_token_id=eos_token_id, bos_token_id=None,
                pad_token_id=None)
    if family != "qwen3_next":  # Qwen3.5's published M-RoPE sections (over the 2 rotary frequencies here)
        args["rope_parameters"] = {**args["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    if family != "qwen3_5":  # Qwen3.5 (dense) has a plain SwiGLU MLP; the others are MoE
        args.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    norm_topk_prob=True, decoder_sparse_step=1)
    args.update(overrides)
    n = args["num_hidden_layers"]
    args["layer_types"] = hybrid_layer_types(n) if hybrid else ["full_attention"] * n
    return args


def family_config(family: str, vocab_size: int, eos_token_id: int | None, hybrid: bool = False, **overrides):
    """A tiny transformers config of ``family``: qwen3_next (MoE), qwen3_5 (dense) or qwen3_5_moe
    (the last two composite, with a tiny vision tower), every layer full attention or, with
    ``hybrid``, three Gated DeltaNet layers to one full-attention layer (4 layers by default);
    deepseek_v3: MLA, a dense first layer, then MoE with 4 expert groups."""
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(**_qwen_text(family, vocab_size, eos_token_id, hybrid, overrides))
    if family in ("qwen3_5", "qwen3_5_moe"):
        import transformers

        cls = transformers.Qwen3_5Config if family == "qwen3_5" else transformers.Qwen3_5MoeConfig
        text = _qwen_text(family, vocab_size, eos_token_id, hybrid, overrides)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"])
        return cls(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        args = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    tie_word_embeddings=False, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
        args.update(overrides)
        return DeepseekV3Config(**args)
    raise ValueError(f"unknown family {family!r}")


def _model_class(family: str):
    import transformers

    if family == "qwen3_5":
        return transformers.Qwen3_5ForConditionalGeneration  # the published composite layout
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForConditionalGeneration
    return transformers.AutoModelForCausalLM


def build_family_target(path: str | Path, family: str, seed: int = 0, hybrid: bool = False, **overrides) -> Path:
    """Save a random ``family`` model (float32, safetensors, transformers' own saver) plus a
    tokenizer; loadable by transformers and mlx-lm (mlx-lm reads top-level ``rope_theta`` /
    ``partial_rotary_factor`` and, for Qwen3-Next, ``full_attention_interval`` instead of
    ``layer_types``, so those are written too). ``hybrid``: the Qwen families' 3 : 1 pattern."""
    import torch

    from speculant.testing.tiny import build_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = family_config(family, len(tokenizer), tokenizer.eos_token_id, hybrid=hybrid, **overrides)
    torch.manual_seed(seed)
    cls = _model_class(family)
    model = (cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    raw = target_config(path)
    if family in ("qwen3_5", "qwen3_5_moe"):
        raw["text_config"]["full_attention_interval"] = 4 if hybrid else 1  # mlx-lm's key for the pattern
    else:
        rope = raw.get("rope_parameters") or {}
        raw.setdefault("rope_theta", rope.get("rope_theta", 10000.0))  # mlx-lm reads the top-level keys
    if family == "qwen3_next":
        raw.update(full_attention_interval=4 if hybrid else 1, partial_rotary_factor=rope.get("partial_rotary_factor", 1.0))
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def family_of(target_path: str | Path, updates: dict | None = None) -> str:
    """The family (top-level ``model_type``) of a target folder, ``updates`` laid over its config."""
    return {**target_config(target_path), **(updates or {})}["model_type"]


def family_mtp_tensors(target_path: str | Path, num_layers: int = 1, seed: int = 0, scale: float = 1.0,
                       packed: bool | None = None, norm_jitter: float = 0.1, fc: np.ndarray | None = None,
                       copies: bool = True, updates: dict | None = None) -> dict[str, np.ndarray]:
    """Random MTP weights of the target's family in the published names (raw Hugging Face:
    Qwen norms stored as gain - 1). ``packed``: packed experts instead of per-expert tensors
    (default: packed for Qwen3.5-MoE, per-expert for Qwen3-Next); a dense Qwen3.5 target gets a
    dense MTP MLP; ``fc``: the [H, 2H] input projection (random otherwise); ``copies``:
    DeepSeek's embed_tokens / shared_head.head copies of the target's; ``updates``: config keys
    laid over the target's (an MoE MTP folder for a dense target)."""
    from safetensors.numpy import load_file

    from speculant.core.validator import text_config

    family = family_of(target_path, updates)
    tcfg = {**text_config(target_config(target_path)), **(updates or {})}
    layout = FAMILY_LAYOUT[family]
    packed = family == "qwen3_5_moe" if packed is None else packed
    H, nh = tcfg["hidden_size"], tcfg["num_attention_heads"]
    rng = np.random.default_rng(seed)
    offset = 1.0 if layout == "qwen" else 0.0

    def w(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1.0 + norm_jitter * rng.standard_normal(n) - offset).astype(np.float32)

    def swiglu(prefix, inter):
        return {prefix + "gate_proj.weight": w(inter, H), prefix + "up_proj.weight": w(inter, H), prefix + "down_proj.weight": w(H, inter)}

    def moe(p):
        E, inter = (tcfg["num_experts"], tcfg["moe_intermediate_size"]) if layout == "qwen" else (tcfg["n_routed_experts"], tcfg["moe_intermediate_size"])
        out = {p + "mlp.gate.weight": w(E, H)}
        if packed:
            out[p + "mlp.experts.gate_up_proj"] = w(E, 2 * inter, H)
            out[p + "mlp.experts.down_proj"] = w(E, H, inter)
        else:
            for e in range(E):
                out.update(swiglu(f"{p}mlp.experts.{e}.", inter))
        if layout == "qwen":
            out.update(swiglu(p + "mlp.shared_expert.", tcfg["shared_expert_intermediate_size"]))
            out[p + "mlp.shared_expert_gate.weight"] = w(1, H)
        else:
            out[p + "mlp.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(E)).astype(np.float32)
            out.update(swiglu(p + "mlp.shared_experts.", inter * tcfg["n_shared_experts"]))
        return out

    out: dict[str, np.ndarray] = {}
    if layout == "qwen":
        hd = tcfg["head_dim"]
        out.update({"mtp.fc.weight": w(H, 2 * H) if fc is None else fc, "mtp.pre_fc_norm_embedding.weight": norm(H),
                    "mtp.pre_fc_norm_hidden.weight": norm(H), "mtp.norm.weight": norm(H)})
        for i in range(num_layers):
            p = f"mtp.layers.{i}."
            a = p + "self_attn."
            out.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                        a + "q_proj.weight": w(2 * nh * hd, H), a + "k_proj.weight": w(tcfg["num_key_value_heads"] * hd, H),
                        a + "v_proj.weight": w(tcfg["num_key_value_heads"] * hd, H), a + "o_proj.weight": w(H, nh * hd),
                        a + "q_norm.weight": norm(hd), a + "k_norm.weight": norm(hd)})
            out.update(moe(p) if tcfg.get("num_experts") else swiglu(p + "mlp.", tcfg["intermediate_size"]))
        return out
    target = load_file(str(Path(target_path) / "model.safetensors"))
    qk = tcfg["qk_nope_head_dim"] + tcfg["qk_rope_head_dim"]
    kvr, qr = tcfg["kv_lora_rank"], tcfg.get("q_lora_rank")
    for k in range(num_layers):
        layer = tcfg["num_hidden_layers"] + k
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        out.update({p + "eh_proj.weight": w(H, 2 * H) if fc is None else fc, p + "enorm.weight": norm(H),
                    p + "hnorm.weight": norm(H), p + "shared_head.norm.weight": norm(H),
                    p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                    a + "kv_a_proj_with_mqa.weight": w(kvr + tcfg["qk_rope_head_dim"], H), a + "kv_a_layernorm.weight": norm(kvr),
                    a + "kv_b_proj.weight": w(nh * (tcfg["qk_nope_head_dim"] + tcfg["v_head_dim"]), kvr),
                    a + "o_proj.weight": w(H, nh * tcfg["v_head_dim"])})
        if qr:
            out.update({a + "q_a_proj.weight": w(qr, H), a + "q_a_layernorm.weight": norm(qr), a + "q_b_proj.weight": w(nh * qk, qr)})
        else:
            out[a + "q_proj.weight"] = w(nh * qk, H)
        out.update(moe(p) if layer >= tcfg.get("first_k_dense_replace", 0) else swiglu(p + "mlp.", tcfg["intermediate_size"]))
        if copies:
            out[p + "embed_tokens.weight"] = target["model.embed_tokens.weight"]
            out[p + "shared_head.head.weight"] = target["lm_head.weight"]
    return out


def build_family_mtp(target_path: str | Path, folder: str | Path | None = None, num_layers: int = 1, seed: int = 0,
                     scale: float = 1.0, packed: bool | None = None, cycle: list[int] | None = None,
                     updates: dict | None = None) -> Path:
    """The target family's MTP layers, in the target folder or in ``folder`` (whose config.json
    gets ``updates``). With the bigram ``cycle``, the input projection is the token path [M, 0]
    (see :func:`bigram_mtp`), so drafts are right as far as the random block (``scale``) lets them be.
    A composite (Qwen3.5) config gets ``mtp_num_hidden_layers`` under ``text_config``, as published."""
    raw = {**target_config(target_path), **(updates or {})}
    layout = FAMILY_LAYOUT[raw["model_type"]]
    fc = None
    if cycle is not None:
        m = successor_map(target_path, cycle, 0)
        fc = np.concatenate([m, np.zeros_like(m)], axis=1)
    tensors = family_mtp_tensors(target_path, num_layers, seed, scale, packed, norm_jitter=0.0 if cycle else 0.1, fc=fc,
                                 updates=updates)
    return write_mtp(target_path, tensors, layout, num_layers, folder, config_updates=updates,
                     text_config=isinstance(raw.get("text_config"), dict))
