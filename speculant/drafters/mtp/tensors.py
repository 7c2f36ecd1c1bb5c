"""MTP tensor names and shapes per layout, read from safetensors headers (no weights loaded),
and the parameters a loader builds from them (renamed, per-expert tensors packed)."""

from __future__ import annotations

from pathlib import Path

from speculant.core.checkpoint import safetensors_metadata
from speculant.drafters.mtp.config import Layout, MTPConfig


def assemble(raw: dict, cfg: MTPConfig, stack, concatenate) -> dict:
    """Module parameters from checkpoint tensors ``raw``: renamed ones and packed ones (per-expert
    tensors stacked into [E, ...], gate and up concatenated), with the backend's array functions."""
    state = {cfg.names[name]: value for name, value in raw.items() if name in cfg.names}
    for param, rows in cfg.packed.items():
        if all(name in raw for row in rows for name in row):
            state[param] = stack([concatenate([raw[name] for name in row]) if len(row) > 1 else raw[row[0]] for row in rows])
    return state


def wanted_tensors(cfg: MTPConfig) -> set[str]:
    """Every checkpoint tensor the loader reads."""
    return set(cfg.names) | {name for rows in cfg.packed.values() for row in rows for name in row}


def safetensors_format(file: str | Path) -> str | None:
    """The ``format`` entry of a safetensors file's ``__metadata__`` (``pt``, ``mlx``...)."""
    return safetensors_metadata(file).get("format")


def mtp_names(inventory: dict, layout: Layout, first_layer: int) -> dict:
    """The tensors of ``inventory`` that belong to the MTP layers of ``layout``."""
    if layout == "qwen":
        return {k: v for k, v in inventory.items() if k.startswith("mtp.")}
    out = {}
    for name, meta in inventory.items():
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= first_layer:
            out[name] = meta
    return out


def attention_tensors(cfg: MTPConfig) -> dict[str, tuple[int, ...]]:
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    a = "self_attn."
    if cfg.mla is not None:
        m = cfg.mla
        out = {a + "kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, H),
               a + "kv_a_layernorm.weight": (m.kv_lora_rank,),
               a + "kv_b_proj.weight": (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
               a + "o_proj.weight": (H, nh * m.v_head_dim)}
        if m.q_lora_rank is None:
            out[a + "q_proj.weight"] = (nh * m.qk_head_dim, H)
        else:
            out.update({a + "q_a_proj.weight": (m.q_lora_rank, H), a + "q_a_layernorm.weight": (m.q_lora_rank,),
                        a + "q_b_proj.weight": (nh * m.qk_head_dim, m.q_lora_rank)})
        if cfg.attention_bias:
            out[a + "kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
            out[a + "o_proj.bias"] = (H,)
            if m.q_lora_rank is not None:
                out[a + "q_a_proj.bias"] = (m.q_lora_rank,)
        return out
    q_rows = nh * hd * (2 if cfg.attn_output_gate else 1)
    out = {a + "q_proj.weight": (q_rows, H), a + "k_proj.weight": (nkv * hd, H),
           a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd)}
    if cfg.qk_norm:
        out[a + "q_norm.weight"] = (hd,)
        out[a + "k_norm.weight"] = (hd,)
    if cfg.attention_bias:
        out.update({a + "q_proj.bias": (q_rows,), a + "k_proj.bias": (nkv * hd,),
                    a + "v_proj.bias": (nkv * hd,), a + "o_proj.bias": (H,)})
    return out


def swiglu_tensors(prefix: str, H: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, H), prefix + "up_proj.weight": (inter, H), prefix + "down_proj.weight": (H, inter)}


def block_tensors(cfg: MTPConfig, layer: int) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, list[list[str]]]]:
    """One decoder block, names relative to the block: (checkpoint tensor -> shape, checkpoint
    tensor -> module parameter for the tensors loaded as they are, module parameter -> rows of
    checkpoint tensors for the per-expert tensors that are stacked)."""
    H = cfg.hidden_size
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,), **attention_tensors(cfg)}
    packed: dict[str, list[list[str]]] = {}
    renames: dict[str, str] = {}
    if not cfg.is_moe(layer):
        shapes.update(swiglu_tensors("mlp.", H, cfg.intermediate_size))
    else:
        m = cfg.moe
        E, inter = m.num_experts, m.intermediate_size
        shapes["mlp.gate.weight"] = (E, H)
        if m.scoring == "sigmoid":
            shapes["mlp.gate.e_score_correction_bias"] = (E,)
        if m.packed:
            shapes["mlp.experts.gate_up_proj"] = (E, 2 * inter, H)
            shapes["mlp.experts.down_proj"] = (E, H, inter)
        else:
            for e in range(E):
                shapes.update(swiglu_tensors(f"mlp.experts.{e}.", H, inter))
            packed["mlp.experts.gate_up_proj"] = [[f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"] for e in range(E)]
            packed["mlp.experts.down_proj"] = [[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)]
        if m.shared_intermediate_size:
            shared = swiglu_tensors(f"mlp.{m.shared_name}.", H, m.shared_intermediate_size)
            shapes.update(shared)
            renames.update({name: "mlp.shared." + name[len(f"mlp.{m.shared_name}."):] for name in shared})
        if m.shared_gate:
            shapes["mlp.shared_expert_gate.weight"] = (1, H)
            renames["mlp.shared_expert_gate.weight"] = "mlp.shared_gate.weight"
    stacked = {name for rows in packed.values() for row in rows for name in row}
    names = {name: renames.get(name, name) for name in shapes if name not in stacked}
    return shapes, names, packed


def expected_tensors(cfg: MTPConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(every tensor of the published layout with its shape, the optional ones), and fills
    ``cfg.names`` / ``cfg.packed`` with how checkpoint tensors become module parameters."""
    H, V = cfg.hidden_size, cfg.vocab_size
    expected: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    names: dict[str, str] = {}
    packed: dict[str, list[list[str]]] = {}

    def add_block(prefix: str, k: int) -> None:
        shapes, renames, stacks = block_tensors(cfg, k)
        expected.update({prefix + name: shape for name, shape in shapes.items()})
        names.update({prefix + name: f"blocks.{k}." + param for name, param in renames.items()})
        packed.update({f"blocks.{k}." + param: [[prefix + n for n in row] for row in rows] for param, rows in stacks.items()})

    if cfg.layout == "qwen":
        heads = {"mtp.fc.weight": ("proj.0.weight", (H, 2 * H)),
                 "mtp.pre_fc_norm_embedding.weight": ("enorm.0.weight", (H,)),
                 "mtp.pre_fc_norm_hidden.weight": ("hnorm.0.weight", (H,)),
                 "mtp.norm.weight": ("norm.0.weight", (H,))}
        for name, (param, shape) in heads.items():
            expected[name], names[name] = shape, param
        for i in range(cfg.num_layers):
            add_block(f"mtp.layers.{i}.", i)
    else:
        for k in range(cfg.num_layers):
            p = f"model.layers.{cfg.first_layer + k}."
            heads = {"eh_proj.weight": (f"proj.{k}.weight", (H, 2 * H)), "enorm.weight": (f"enorm.{k}.weight", (H,)),
                     "hnorm.weight": (f"hnorm.{k}.weight", (H,)), "shared_head.norm.weight": (f"norm.{k}.weight", (H,))}
            for name, (param, shape) in heads.items():
                expected[p + name], names[p + name] = shape, param
            add_block(p, k)
            for copy in ("embed_tokens.weight", "shared_head.head.weight"):  # copies of the target's; ignored
                expected[p + copy] = (V, H)
                optional.add(p + copy)
    cfg.names, cfg.packed = names, packed
    return expected, optional
