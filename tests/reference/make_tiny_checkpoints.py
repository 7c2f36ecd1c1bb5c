"""Tiny real checkpoints for reference-parity tests.

Writes a random Qwen3 target (transformers ``save_pretrained``, float32 safetensors, plus a
``tokenizer.json`` that ``AutoTokenizer`` loads offline) and tiny DFlash / DFlash2 drafts in the
published on-disk format (un-prefixed tensor names, no embedding or head, DFlash2 codebooks
without a ``.weight`` suffix), so the official ``dflash`` package loads them with no missing or
unexpected keys.

Needs only torch, transformers, tokenizers and safetensors; runs with the system interpreter or
the reference venv's. Self-contained on purpose (no speculant imports).

    python tests/reference/make_tiny_checkpoints.py OUT_DIR [--planted] [--seed 0]

creates OUT_DIR/target, OUT_DIR/dflash and OUT_DIR/dflash2.

"Planted" targets: every embedding row gets a shared component ``u`` and the head row of one
token (``PLANTED_TOKEN``) is aligned with ``u``. The residual stream of the target and of any
draft that borrows its embedding and head then carries ``u``, so both often predict the planted
token and random drafts reach a high acceptance length while the target still emits other tokens.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file

VOCAB_SIZE = 256
HIDDEN_SIZE = 64
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 16
INTERMEDIATE_SIZE = 128
ROPE_THETA = 10000.0
MAX_POSITIONS = 512
RMS_NORM_EPS = 1e-6

UNK_TOKEN, EOS_TOKEN, MASK_TOKEN = "<|unk|>", "<|endoftext|>", "<|mask|>"
UNK_ID, EOS_ID, MASK_ID = VOCAB_SIZE - 3, VOCAB_SIZE - 2, VOCAB_SIZE - 1
PLANTED_TOKEN = 7
# Tuned (seed 0) so block 4 reaches a mean acceptance length of about 2.6-3.4 on the reference
# while 10-30 % of the target's greedy tokens are not the planted one. At embed scale 1.0 the
# target emits only the planted token; at 0.3 acceptance drops to about 1.5.
PLANTED_EMBED_SCALE = 0.5
PLANTED_HEAD_SCALE = 5.0

_WORDS = [f"w{i}" for i in range(VOCAB_SIZE - 3)]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _normal(gen: torch.Generator, *shape: int, std: float) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def _linear(gen: torch.Generator, out_features: int, in_features: int, gain: float = 1.0):
    return _normal(gen, out_features, in_features, std=gain / math.sqrt(in_features))


def _norm_weight(gen: torch.Generator, size: int) -> torch.Tensor:
    # Not exactly one, so a loader that drops a norm weight changes the numbers.
    return 1.0 + _normal(gen, size, std=0.1)


def build_tokenizer(out_dir: str | Path) -> None:
    """WordLevel tokenizer over ``w0 .. w252`` plus three special tokens (ids 253, 254, 255)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(_WORDS)}
    vocab.update({UNK_TOKEN: UNK_ID, EOS_TOKEN: EOS_ID, MASK_TOKEN: MASK_ID})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
    )
    fast.save_pretrained(str(out_dir))


def target_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=RMS_NORM_EPS,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        bos_token_id=None,
        architectures=["Qwen3ForCausalLM"],
    )


def build_target(
    out_dir: str | Path,
    planted: bool = False,
    seed: int = 0,
    planted_token: int = PLANTED_TOKEN,
    embed_scale: float = PLANTED_EMBED_SCALE,
    head_scale: float = PLANTED_HEAD_SCALE,
) -> Path:
    """Random float32 Qwen3 target with tokenizer; ``planted`` adds the shared direction."""
    from transformers import Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = _generator(seed)
    model = Qwen3ForCausalLM(target_config()).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(_norm_weight(gen, param.shape[0]))
            elif name.endswith("embed_tokens.weight"):
                param.copy_(_normal(gen, *param.shape, std=1.0))
            else:  # linear layers incl. lm_head: unit-variance outputs
                param.copy_(_linear(gen, *param.shape))
        if planted:
            u = _normal(gen, HIDDEN_SIZE, std=1.0)
            u = u / u.norm()
            model.model.embed_tokens.weight.add_(embed_scale * math.sqrt(HIDDEN_SIZE) * u)
            model.lm_head.weight[planted_token] = head_scale * u
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out)
    return out


def _read_target_config(target_dir: str | Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def _draft_layer_tensors(gen: torch.Generator, i: int, cfg: dict) -> dict[str, torch.Tensor]:
    h, hd, i_size = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    p = f"layers.{i}."
    return {
        p + "input_layernorm.weight": _norm_weight(gen, h),
        p + "post_attention_layernorm.weight": _norm_weight(gen, h),
        p + "self_attn.q_proj.weight": _linear(gen, nh * hd, h),
        p + "self_attn.k_proj.weight": _linear(gen, nkv * hd, h),
        p + "self_attn.v_proj.weight": _linear(gen, nkv * hd, h),
        p + "self_attn.o_proj.weight": _linear(gen, h, nh * hd),
        p + "self_attn.q_norm.weight": _norm_weight(gen, hd),
        p + "self_attn.k_norm.weight": _norm_weight(gen, hd),
        p + "mlp.gate_proj.weight": _linear(gen, i_size, h),
        p + "mlp.up_proj.weight": _linear(gen, i_size, h),
        p + "mlp.down_proj.weight": _linear(gen, h, i_size),
    }


def _conv_tensors(gen: torch.Generator, prefix: str, hidden: int, kernel: int, group: int):
    groups = hidden // group
    base = _normal(gen, 2, kernel, hidden, std=0.1)
    base[:, 0, :] += 1.0  # tap 0 ~ identity, so the sublayers see their inputs
    return {
        prefix + ".base_kernel": base,
        prefix + ".kernel_projection.weight": _linear(gen, 2 * kernel * groups, hidden, gain=0.1),
    }


def _draft_config(
    tcfg: dict,
    architecture: str,
    num_layers: int,
    target_layer_ids: Sequence[int],
    block_size: int,
    layer_type: str,
) -> dict:
    return {
        "architectures": [architecture],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "float32",
        "head_dim": tcfg["head_dim"],
        "hidden_act": "silu",
        "hidden_size": tcfg["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": tcfg["intermediate_size"],
        "layer_types": [layer_type] * num_layers,
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "max_window_layers": num_layers,
        "num_attention_heads": tcfg["num_attention_heads"],
        "num_hidden_layers": num_layers,
        "num_key_value_heads": tcfg["num_key_value_heads"],
        "num_target_layers": tcfg["num_hidden_layers"],
        "rms_norm_eps": tcfg["rms_norm_eps"],
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": tcfg["vocab_size"],
        "eos_token_id": tcfg.get("eos_token_id"),
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(target_layer_ids)},
        "_block_size": block_size,
    }


def _shared_tensors(gen: torch.Generator, cfg: dict, n_features: int) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    return {
        "fc.weight": _linear(gen, h, n_features * h),
        "hidden_norm.weight": _norm_weight(gen, h),
        "norm.weight": _norm_weight(gen, h),
    }


def _write_draft(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.contiguous().to(torch.float32) for k, v in sorted(tensors.items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_dflash(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    num_layers: int = 2,
    target_layer_ids: Sequence[int] = (1, 2),
    block_size: int = 4,
    seed: int = 1,
) -> Path:
    """DFlash (v1) draft in the published v1 layout: top-level ``block_size`` and ``rope_theta``,
    ``dflash_config = {mask_token_id, target_layer_ids}``, full-attention layers."""
    tcfg = _read_target_config(target_dir)
    cfg = _draft_config(tcfg, "DFlashDraftModel", num_layers, target_layer_ids, block_size,
                        "full_attention")
    cfg["block_size"] = cfg.pop("_block_size")
    cfg["rope_theta"] = _rope_theta(tcfg)
    cfg["rope_scaling"] = None
    cfg["sliding_window"] = None
    cfg["use_sliding_window"] = False
    gen = _generator(seed)
    tensors = _shared_tensors(gen, cfg, len(target_layer_ids))
    for i in range(num_layers):
        tensors.update(_draft_layer_tensors(gen, i, cfg))
    return _write_draft(Path(out_dir), cfg, tensors)


def build_dflash2(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    num_layers: int = 2,
    target_layer_ids: Sequence[int] = (1, 2),
    block_size: int = 4,
    sliding_window: int = 2048,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 16,
    selector_top_k: int = 8,
    seed: int = 2,
) -> Path:
    """DFlash2 draft in the published layout: ``is_causal: false``, sliding-attention layers,
    ``rope_parameters``, everything DFlash-specific (incl. ``block_size``) in ``dflash_config``,
    grouped dynamic convs and the candidate selector (codebooks stored without ``.weight``)."""
    tcfg = _read_target_config(target_dir)
    cfg = _draft_config(tcfg, "DFlash2DraftModel", num_layers, target_layer_ids, block_size,
                        "sliding_attention")
    cfg["dflash_config"].update(
        block_size=cfg.pop("_block_size"),
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
    )
    cfg["is_causal"] = False
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": _rope_theta(tcfg)}
    cfg["sliding_window"] = sliding_window
    cfg["use_sliding_window"] = True
    gen = _generator(seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    tensors = _shared_tensors(gen, cfg, len(target_layer_ids))
    for i in range(num_layers):
        tensors.update(_draft_layer_tensors(gen, i, cfg))
        for conv in ("attention_conv", "mlp_conv"):
            tensors.update(_conv_tensors(gen, f"layers.{i}.{conv}", h, conv_kernel_size,
                                         conv_group_size))
    tensors["candidate_selector.hidden_projection.weight"] = _linear(gen, selector_rank, h)
    tensors["candidate_selector.predecessor_codebook"] = _normal(gen, v, selector_rank, std=0.5)
    tensors["candidate_selector.successor_codebook"] = _normal(gen, v, selector_rank, std=0.5)
    return _write_draft(Path(out_dir), cfg, tensors)


def _rope_theta(tcfg: dict) -> float:
    rope = tcfg.get("rope_parameters") or tcfg.get("rope_scaling") or {}
    return float(tcfg.get("rope_theta", rope.get("rope_theta", ROPE_THETA)))


def build_all(out_dir: str | Path, planted: bool = False, seed: int = 0) -> dict[str, Path]:
    """target + dflash + dflash2 under ``out_dir``; returns their paths by name."""
    out = Path(out_dir)
    target = build_target(out / "target", planted=planted, seed=seed)
    return {
        "target": target,
        "dflash": build_dflash(out / "dflash", target, seed=seed + 1),
        "dflash2": build_dflash2(out / "dflash2", target, seed=seed + 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--planted", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = build_all(args.out_dir, planted=args.planted, seed=args.seed)
    print(json.dumps({k: str(v) for k, v in paths.items()}))


if __name__ == "__main__":
    main()
