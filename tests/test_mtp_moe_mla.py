"""MTP blocks with mixture-of-experts MLPs and DeepSeek MLA attention, on tiny real checkpoints.

- One MTP block of ours equals transformers' own decoder layer on the same stored weights:
  Qwen3NextDecoderLayer (softmax-routed experts, per-expert and Qwen3.5-MoE packed spellings,
  gated shared expert) and DeepseekV3DecoderLayer (MLA with and without q_lora_rank, default
  and YaRN RoPE, sigmoid group-limited routing with correction bias); MLX equals PyTorch.
- Greedy speculative output equals plain greedy output: a Qwen3-Next target (PyTorch only:
  mlx-lm's Qwen3-Next needs at least one GatedDeltaNet layer, whose cache the MLX backend cannot
  roll back, so on MLX a Qwen3 target carries the Qwen3-Next-style MoE MTP layer) and a
  DeepSeek-V3 target (both backends; on MLX the MTP layer sits in its own folder, as mlx-lm's
  loader drops only ``model.layers.61``), PyTorch and MLX agreeing cycle for cycle.
- The validator names a missing expert tensor, a mis-shaped packed one, FP8 weights.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.api import validate
from speculant.testing.tiny_mtp import build_bigram_target, copy_target, target_config, write_mtp
from speculant.testing.tiny_mtp_families import build_family_mtp, build_family_target, family_mtp_tensors

torch = pytest.importorskip("torch")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
PROMPT_TAIL = [7, 9, 150]


def config(kind, target, folder=None):
    out = {"backend": {"kind": kind, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    out["drafter"] = {"kind": "mtp"} if folder is None else {"kind": "mtp", "path": str(folder)}
    return out


def errors(report):
    return [str(p) for p in report.errors]


@pytest.fixture(scope="module")
def targets(tmp_path_factory, torch_threads):
    """Random tiny targets of each family and variant (no MTP weights yet)."""
    root = tmp_path_factory.mktemp("moe_mla")
    return {
        "qwen3_next": build_family_target(root / "qwen3_next", "qwen3_next", seed=1),
        "deepseek": build_family_target(root / "deepseek", "deepseek_v3", seed=2),
        "deepseek_q_proj": build_family_target(root / "deepseek_q_proj", "deepseek_v3", seed=3, q_lora_rank=None),
        "deepseek_yarn": build_family_target(root / "deepseek_yarn", "deepseek_v3", seed=4, rope_parameters=YARN),
        "root": root,
    }


def mtp_folder(targets, name, tensors):
    tcfg = target_config(targets[name])
    layout = "qwen" if tcfg["model_type"] == "qwen3_next" else "deepseek"
    return write_mtp(targets[name], tensors, layout, 1, folder=targets["root"] / f"mtp_{name}_{len(list(targets['root'].iterdir()))}")


def torch_model(target, folder):
    from speculant.drafters.mtp.torch import build_model, read_mtp_tensors

    cfg = drafter_config(target, folder)
    return build_model(cfg, read_mtp_tensors(cfg)).float().eval(), cfg


def drafter_config(target, folder):
    from speculant.core.validator import read_target_info
    from speculant.drafters.mtp.config import MTPOptions
    from speculant.drafters.mtp.parse import parse_mtp

    cfg, problems = parse_mtp(folder, read_target_info(target), MTPOptions(), separate=True)
    assert cfg is not None and not [p for p in problems if p.severity == "error"], [str(p) for p in problems]
    return cfg


def hf_layer(target, layer_cls, index, state):
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(str(target))
    hf_cfg._attn_implementation = "eager"
    layer = layer_cls(hf_cfg, index).float().eval()
    missing, unexpected = layer.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if not k.endswith("e_score_correction_bias")], (missing, unexpected)
    return hf_cfg, layer


def packed_experts(state, prefix, experts):
    """Per-expert gate/up/down tensors as transformers' packed parameters (an independent stacking)."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    gate_up = [np.concatenate([state[f"{prefix}experts.{e}.gate_proj.weight"], state[f"{prefix}experts.{e}.up_proj.weight"]]) for e in range(experts)]
    out[prefix + "experts.gate_up_proj"] = np.stack(gate_up)
    out[prefix + "experts.down_proj"] = np.stack([state[f"{prefix}experts.{e}.down_proj.weight"] for e in range(experts)])
    return out


def block_inputs(H, n=6, start=3):
    x = torch.randn(n, H, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(start, start + n)
    mask = torch.full((n, n), -torch.inf).triu(1)[None, None]
    return x, pos, mask


def ours(model, x, pos, split=None):
    """Our block 0 over the rows of x, in one call or in two calls sharing the cache."""
    from speculant.drafters.mtp.torch import LayerCache, rope_tables

    cache, outs = LayerCache(), []
    cuts = [0, x.shape[0]] if split is None else [0, split, x.shape[0]]
    with torch.no_grad():
        for a, b in zip(cuts, cuts[1:]):
            cos, sin = rope_tables(model.inv_freq, pos[a:b], x.dtype, model.rope_scale)
            outs.append(model.blocks[0](x[a:b], cos, sin, pos[a:b], cache))
    return torch.cat(outs)


def mlx_block(cfg, x, pos):
    mx = pytest.importorskip("mlx.core")
    from speculant.drafters.mtp import mlx as M

    model = M.build_model(cfg, M.read_mtp_tensors(cfg))
    out = model.blocks[0](mx.array(x.numpy()), [int(p) for p in pos], M.LayerCache())
    return np.array(out)


# -- one block against transformers ----------------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True], ids=["per_expert", "packed"])
def test_qwen_moe_block_equals_transformers_qwen3_next_layer(targets, packed):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRotaryEmbedding

    target = targets["qwen3_next"]
    stored = family_mtp_tensors(target, seed=5, packed=packed)
    model, cfg = torch_model(target, mtp_folder(targets, "qwen3_next", stored))
    assert cfg.moe.packed is packed and cfg.moe.scoring == "softmax" and cfg.attn_output_gate
    block = {k[len("mtp.layers.0."):]: v for k, v in stored.items() if k.startswith("mtp.layers.0.")}
    state = block if packed else packed_experts(block, "mlp.", cfg.moe.num_experts)
    hf_cfg, layer = hf_layer(target, Qwen3NextDecoderLayer, 0, state)
    x, pos, mask = block_inputs(cfg.hidden_size)
    with torch.no_grad():
        cos, sin = Qwen3NextRotaryEmbedding(hf_cfg)(x[None], pos[None])
        expected = layer(x[None], (cos, sin), attention_mask=mask, position_ids=pos[None])[0]
    torch.testing.assert_close(ours(model, x, pos), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(model, x, pos, split=4), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["deepseek", "deepseek_q_proj", "deepseek_yarn"])
def test_deepseek_block_equals_transformers_deepseek_v3_layer(targets, variant):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

    target = targets[variant]
    stored = family_mtp_tensors(target, seed=6)
    model, cfg = torch_model(target, mtp_folder(targets, variant, stored))
    assert cfg.mla is not None and cfg.is_moe(0) and cfg.moe.scoring == "sigmoid" and cfg.rope_interleave
    n = cfg.first_layer
    prefix = f"model.layers.{n}."
    heads = ("eh_proj", "enorm", "hnorm", "shared_head", "embed_tokens")
    block = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix) and not k[len(prefix):].startswith(heads)}
    hf_cfg, layer = hf_layer(target, DeepseekV3DecoderLayer, n, packed_experts(block, "mlp.", cfg.moe.num_experts))
    with torch.no_grad():
        layer.mlp.gate.e_score_correction_bias.copy_(torch.from_numpy(block["mlp.gate.e_score_correction_bias"]))
    x, pos, mask = block_inputs(cfg.hidden_size, start=40)  # past original_max_position_embeddings / factor
    with torch.no_grad():
        cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(x[None], pos[None])
        expected = layer(x[None], attention_mask=mask, position_ids=pos[None], position_embeddings=(cos, sin))[0]
    if variant == "deepseek_yarn":
        assert cfg.rope["rope_type"] == "yarn" and model.rope_scale != 1.0 and cfg.softmax_scale != cfg.mla.qk_head_dim ** -0.5
    torch.testing.assert_close(ours(model, x, pos), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(model, x, pos, split=2), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.mlx
@pytest.mark.parametrize("variant,packed", [("qwen3_next", False), ("qwen3_next", True), ("deepseek", False),
                                            ("deepseek_q_proj", False), ("deepseek_yarn", False)])
def test_mlx_block_equals_torch(targets, variant, packed):
    pytest.importorskip("mlx.core")
    folder = mtp_folder(targets, variant, family_mtp_tensors(targets[variant], seed=7, packed=packed))
    model, cfg = torch_model(targets[variant], folder)
    x, pos, _ = block_inputs(cfg.hidden_size, start=40)
    np.testing.assert_allclose(mlx_block(cfg, x, pos), ours(model, x, pos).numpy(), atol=2e-5, rtol=1e-5)


# -- greedy losslessness -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pairs(tmp_path_factory, torch_threads):
    """Bigram-planted targets with MTP layers whose drafts are accepted part of the time."""
    root = tmp_path_factory.mktemp("moe_mla_pairs")
    out = {}
    for family in ("qwen3_next", "deepseek_v3"):
        base, cycle = build_bigram_target(root / family, family=family, layer_scale=0.1)
        target = copy_target(base, root / f"{family}_with_mtp")
        build_family_mtp(target, cycle=cycle, seed=3)  # in the target folder, as published
        out[family] = (target, None, cycle)
    # mlx-lm's DeepSeek-V3 loader only drops model.layers.61 (the real checkpoint's MTP layer), so
    # the tiny target's MTP layer lives in its own folder for MLX
    base, cycle = out["deepseek_v3"][0].parent / "deepseek_v3", out["deepseek_v3"][2]
    out["deepseek_v3_folder"] = (base, build_family_mtp(base, root / "deepseek_v3_mtp", cycle=cycle, seed=3), cycle)
    # MLX: a Qwen3 target with a Qwen3-Next-style MoE MTP layer in its own folder (packed experts)
    target, cycle = build_bigram_target(root / "qwen3", layer_scale=0.1)
    updates = {"model_type": "qwen3_next", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48, "norm_topk_prob": True}
    folder = build_family_mtp(target, root / "qwen3_moe_mtp", cycle=cycle, seed=3, packed=True, updates=updates)
    out["qwen3+moe_mtp"] = (target, folder, cycle)
    return out


def run(kind, target, folder, cycle, drafter=True):
    cfg = config(kind, target, folder)
    if not drafter:
        del cfg["drafter"]
    result = speculant.load_engine(cfg).run(prompt_ids=cycle[:5] + PROMPT_TAIL, max_new_tokens=24, ignore_eos=True)
    return result.token_ids, result.stats.acceptance_lengths


@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3", "qwen3+moe_mtp"])
def test_greedy_equals_plain_on_torch(pairs, name):
    target, folder, cycle = pairs[name]
    assert errors(validate(config("torch", target, folder))) == []
    plain, _ = run("torch", target, folder, cycle, drafter=False)
    spec, accepted = run("torch", target, folder, cycle)
    assert spec == plain
    assert max(accepted) > 1 and min(accepted) == 1, accepted  # both accepted and rejected drafts


@pytest.mark.mlx
@pytest.mark.parametrize("name", ["deepseek_v3_folder", "qwen3+moe_mtp"])
def test_greedy_equals_plain_on_mlx_and_matches_torch(pairs, name):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    target, folder, cycle = pairs[name]
    assert errors(validate(config("mlx", target, folder))) == []
    plain, _ = run("mlx", target, folder, cycle, drafter=False)
    spec, accepted = run("mlx", target, folder, cycle)
    assert spec == plain
    assert (spec, accepted) == run("torch", target, folder, cycle)


# -- validator -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,drop", [("qwen3_next", "mtp.layers.0.mlp.experts.3.up_proj.weight"),
                                          ("qwen3_next", "mtp.layers.0.mlp.shared_expert_gate.weight"),
                                          ("deepseek", "model.layers.2.mlp.experts.5.down_proj.weight"),
                                          ("deepseek", "model.layers.2.mlp.gate.e_score_correction_bias"),
                                          ("deepseek", "model.layers.2.self_attn.kv_b_proj.weight")])
def test_missing_moe_or_mla_tensor_is_named(targets, variant, drop):
    tensors = family_mtp_tensors(targets[variant], seed=8)
    del tensors[drop]
    problems = errors(validate(config("torch", targets[variant], mtp_folder(targets, variant, tensors))))
    assert any(f"missing tensor {drop}" in e for e in problems), problems


def test_misshaped_packed_experts_are_named(targets):
    tensors = family_mtp_tensors(targets["qwen3_next"], seed=8, packed=True)
    tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = tensors["mtp.layers.0.mlp.experts.gate_up_proj"][:, :32].copy()
    problems = errors(validate(config("torch", targets["qwen3_next"], mtp_folder(targets, "qwen3_next", tensors))))
    assert any("mtp.layers.0.mlp.experts.gate_up_proj has shape [8, 32, 64], expected [8, 64, 64]" in e for e in problems), problems


def test_fp8_weights_and_unknown_rope_are_reported(targets):
    tensors = family_mtp_tensors(targets["deepseek"], seed=8)
    tensors["model.layers.2.self_attn.kv_b_proj.weight_scale_inv"] = np.ones((1, 1), dtype=np.float32)
    folder = mtp_folder(targets, "deepseek", tensors)
    problems = errors(validate(config("torch", targets["deepseek"], folder)))
    assert any("(quantization_config)" in e and "weight_scale_inv" in e and "bf16" in e.lower() for e in problems), problems
    target = copy_target(targets["deepseek"], targets["root"] / "deepseek_longrope")
    write_mtp(target, family_mtp_tensors(target, seed=8), "deepseek", 1,
              config_updates={"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}})
    problems = errors(validate(config("torch", target)))
    assert any("(rope_parameters.rope_type)" in e and "longrope" in e for e in problems), problems
