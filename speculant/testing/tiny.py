"""Tiny real models for tests: a Qwen3 target saved with ``save_pretrained`` and DFlash drafts
saved in the published z-lab layout, random weights, optionally with a planted bias so that
drafts are actually accepted.

The planted bias: every embedding row (the mask row included) gets a shared component ``u``
and the LM-head row of one token ``c`` points along ``u``. Target and draft share that
embedding and head, so both lean towards ``c``; the random layers still make the target
choose other tokens some of the time, so both acceptance and rejection happen.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "while True:\n    break\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
]
from speculant.training.tokenizer import EOS_TOKEN, MASK_TOKEN  # noqa: E402,F401  (re-exported)


def build_tokenizer(path: Path, vocab_size: int = 320):
    """A byte-level BPE tokenizer.json with an end-of-text and a mask token (the trainer's)."""
    from speculant.training.tokenizer import train_tokenizer

    return train_tokenizer(CORPUS * 4, path, vocab_size)


def build_tiny_target(
    path: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 4,
    planted: float = 0.0,
    planted_token: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    intermediate_size: int | None = None,
) -> Path:
    """Save a random Qwen3 causal LM (float32, safetensors) plus tokenizer to ``path``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    vocab = len(tokenizer)
    heads = max(2, hidden_size // 16)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * 4)
        if planted:
            plant_bias(model, planted, planted_token, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def plant_bias(model, strength: float, token: int | None, seed: int) -> int:
    """Add a shared direction to all embeddings and point one LM-head row along it."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    u = torch.randn(emb.shape[1], generator=gen)
    u = u / u.norm()
    token = int(token if token is not None else emb.shape[0] // 2)
    emb.add_(u * strength * emb.norm(dim=1, keepdim=True).mean())
    if head.data_ptr() != emb.data_ptr():
        head[token] = u * strength * head.norm(dim=1).mean() * 4
    return token


def target_layer_ids_for(num_target_layers: int, num_features: int) -> list[int]:
    """The published default: evenly from layer 1 to layer N-3 (kept within the target's layers for
    targets of fewer than 4, which the published rule does not cover)."""
    if num_features == 1:
        return [num_target_layers // 2]
    return [min(max(int(round(1 + i * (num_target_layers - 4) / (num_features - 1))), 0), num_target_layers - 1)
            for i in range(num_features)]


def build_tiny_dflash(
    path: str | Path,
    target_path: str | Path,
    seed: int = 0,
    num_layers: int = 2,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    sliding_window: int | None = None,
    scale: float = 1.0,
    extra_config: dict | None = None,
) -> Path:
    """Save a random DFlash draft in the published layout (config.json + model.safetensors),
    shaped like the target's language model (``text_config`` of a composite config)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tcfg = target_text_config(target_path)
    tok = json.loads((Path(target_path) / "tokenizer.json").read_text())
    mask_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == MASK_TOKEN)
    H = tcfg["hidden_size"]
    hd = tcfg.get("head_dim") or H // tcfg["num_attention_heads"]
    nh, nkv, inter = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["intermediate_size"]
    layer_ids = target_layer_ids or target_layer_ids_for(tcfg["num_hidden_layers"], min(3, tcfg["num_hidden_layers"]))
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def ones(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"fc.weight": w(H, len(layer_ids) * H), "hidden_norm.weight": ones(H), "norm.weight": ones(H)}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": ones(H),
            p + "post_attention_layernorm.weight": ones(H),
            p + "self_attn.q_proj.weight": w(nh * hd, H),
            p + "self_attn.k_proj.weight": w(nkv * hd, H),
            p + "self_attn.v_proj.weight": w(nkv * hd, H),
            p + "self_attn.o_proj.weight": w(H, nh * hd),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": w(inter, H),
            p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
        })
    layer_type = "sliding_attention" if sliding_window else "full_attention"
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids},
        "dtype": "float32",
        "head_dim": hd,
        "hidden_act": "silu",
        "hidden_size": H,
        "intermediate_size": inter,
        "layer_types": [layer_type] * num_layers,
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "num_attention_heads": nh,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": nkv,
        "num_target_layers": tcfg["num_hidden_layers"],
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": _rope_theta(tcfg),
        "rope_scaling": None,
        "sliding_window": sliding_window,
        "use_sliding_window": bool(sliding_window),
        "tie_word_embeddings": False,
        "vocab_size": tcfg["vocab_size"],
    }
    config.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def target_text_config(target_path: str | Path) -> dict:
    """The target's language-model config: ``text_config`` laid over a composite (VLM-style)
    config.json such as Qwen3.5's or Muse Glimmer's, the file itself otherwise."""
    from speculant.core.validator import text_config

    return text_config(json.loads((Path(target_path) / "config.json").read_text()))


def _rope_theta(tcfg: dict) -> float:
    if "rope_theta" in tcfg:
        return tcfg["rope_theta"]
    params = tcfg.get("rope_parameters") or {}
    if "rope_theta" not in params and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer kind (Gemma 3)
    return params.get("rope_theta", 10000.0)


def build_tiny_pair(root: str | Path, planted: float = 0.0, seed: int = 0, **draft_kwargs) -> tuple[Path, Path]:
    """A target and a DFlash draft under ``root/target`` and ``root/draft``."""
    root = Path(root)
    target = build_tiny_target(root / "target", seed=seed, planted=planted)
    draft = build_tiny_dflash(root / "draft", target, seed=seed + 7, **draft_kwargs)
    return target, draft


RESIDUAL_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
GEMMA_POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def plant_checkpoint(target_path: str | Path, strength: float = 4.0, soften: float = 0.5, seed: int = 0,
                     token: int | None = None) -> int:
    """:func:`plant_bias` on a saved target of any family (composite checkpoints included), and
    every residual write of its layers (attention, Gated DeltaNet and MLP outputs; Gemma's
    zero-centred post-norm gains) scaled by ``soften``, so the target follows the planted token
    part of the time. Returns the planted token."""
    from safetensors.numpy import load_file, save_file

    file = Path(target_path) / "model.safetensors"
    state = load_file(str(file))
    emb_name = next(n for n in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight") if n in state)
    gemma = target_text_config(target_path).get("model_type", "").startswith("gemma")
    for name in state:
        if ".visual." in name or ".vision_tower." in name:
            continue
        if name.endswith(RESIDUAL_WRITERS) and not gemma:
            state[name] = (state[name] * soften).astype(np.float32)
        elif gemma and name.endswith(GEMMA_POST_NORMS):
            state[name] = ((1.0 + state[name]) * soften - 1.0).astype(np.float32)
    emb = state[emb_name]
    rng = np.random.default_rng(seed + 1)
    u = rng.standard_normal(emb.shape[1]).astype(np.float32)
    u /= np.linalg.norm(u)
    token = int(token if token is not None else emb.shape[0] // 2)
    state[emb_name] = (emb + u * strength * np.linalg.norm(emb, axis=1).mean()).astype(np.float32)
    if "lm_head.weight" in state:
        head = state["lm_head.weight"]
        head[token] = u * strength * np.linalg.norm(head, axis=1).mean() * 4
    save_file(state, str(file), metadata={"format": "pt"})
    return token
