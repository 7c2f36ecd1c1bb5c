"""Tiny MTP checkpoints for tests, written as real safetensors + config.json in both layouts.

Weights are built once in a layout-free *canonical* form, where every norm weight is the
effective gain g multiplying x̂, then written as:

- ``qwen``: ``mtp.*`` names, stored g - 1 (raw Hugging Face, the norm computes x̂·(1 + w)) or g
  when ``shifted`` (an MLX-converted folder, saved with safetensors metadata format=mlx);
- ``deepseek``: ``model.layers.{num_hidden_layers + k}.*`` names, stored g (x̂·w).

So the same canonical weights give the same drafter in every layout, which the norm tests use.

The bigram builders make a real Qwen3 target whose greedy next token is a fixed permutation
``f`` of the current token on a cycle of tokens (attention and MLP outputs scaled down, LM-head
rows aligned with the embeddings), and MTP weights that predict ``f(f(x_t))`` either from the
token x_{t+1} or from the hidden state h_t, or deliberately one step short (``shift``).

Mixture-of-experts / MLA / hybrid families: :func:`build_family_target` saves a real
Qwen3-Next (MoE MLPs; every layer full attention, or with ``hybrid`` the published 3 : 1 pattern
of Gated DeltaNet ``linear_attention`` and ``full_attention`` layers), Qwen3.5 / Qwen3.5-MoE
(the published composite checkpoint: ``text_config``, a tiny vision tower, the language model
under ``model.language_model.*``) or DeepSeek-V3 (MLA attention, a dense first layer then MoE)
target with transformers, optionally planted as the same bigram, and :func:`family_mtp_tensors`
writes its MTP layer in the published names: Qwen3-Next per-expert
``mtp.layers.{i}.mlp.experts.{e}.*``, Qwen3.5 dense ``mtp.layers.{i}.mlp.*``, Qwen3.5-MoE packed
``mlp.experts.gate_up_proj`` / ``down_proj``, and DeepSeek-V3 ``model.layers.{N+k}.*`` with MLA
and the sigmoid-routed MoE.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

NORMS = ("enorm", "hnorm", "norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")
QWEN_HEAD_NAMES = {"proj": "mtp.fc.weight", "enorm": "mtp.pre_fc_norm_embedding.weight",
                   "hnorm": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
DEEPSEEK_HEAD_NAMES = {"proj": "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight", "norm": "shared_head.norm.weight"}


def target_config(target_path: str | Path) -> dict:
    return json.loads((Path(target_path) / "config.json").read_text())


def embedding_name(state) -> str:
    """The target's embedding tensor: ``model.embed_tokens.weight``, or
    ``model.language_model.embed_tokens.weight`` in a composite (Qwen3.5) checkpoint."""
    for name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        if name in state:
            return name
    raise KeyError("the target holds no model.embed_tokens.weight or model.language_model.embed_tokens.weight")


def canonical_mtp(
    target_path: str | Path,
    num_layers: int = 1,
    seed: int = 0,
    scale: float = 1.0,
    gated: bool = False,
    num_heads: int = 1,
    norm_jitter: float = 0.1,
    passthrough: float = 0.0,
) -> dict:
    """Random MTP weights: ``heads`` (fc and the three head norms; 1 shared or one per layer)
    and ``blocks`` (one decoder block per MTP layer), norm entries as effective gains.
    ``passthrough`` adds that multiple of the identity to the fc's embedding half, so drafts
    lean the way the token embedding does (with a planted target: partial acceptance)."""
    tcfg = target_config(target_path)
    H, hd = tcfg["hidden_size"], tcfg["head_dim"]
    nh, nkv, inter = tcfg["num_attention_heads"], tcfg["num_key_value_heads"], tcfg["intermediate_size"]
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def gain(n):
        return (1.0 + norm_jitter * rng.standard_normal(n)).astype(np.float32)

    heads = [{"proj": w(H, 2 * H), "enorm": gain(H), "hnorm": gain(H), "norm": gain(H)} for _ in range(num_heads)]
    for head in heads:
        head["proj"][:, :H] += passthrough * np.eye(H, dtype=np.float32)
    blocks = []
    for _ in range(num_layers):
        blocks.append({
            "input_layernorm": gain(H),
            "post_attention_layernorm": gain(H),
            "self_attn.q_proj": w(nh * hd * (2 if gated else 1), H),
            "self_attn.k_proj": w(nkv * hd, H),
            "self_attn.v_proj": w(nkv * hd, H),
            "self_attn.o_proj": w(H, nh * hd),
            "self_attn.q_norm": gain(hd),
            "self_attn.k_norm": gain(hd),
            "mlp.gate_proj": w(inter, H),
            "mlp.up_proj": w(inter, H),
            "mlp.down_proj": w(H, inter),
        })
    return {"heads": heads, "blocks": blocks}


def _stored(name: str, value: np.ndarray, offset: float) -> np.ndarray:
    return (value - offset).astype(np.float32) if name in NORMS else value


def mtp_tensors(canonical: dict, layout: str, first_layer: int = 0, shifted: bool = False) -> dict[str, np.ndarray]:
    """Canonical weights under the published names of ``layout``."""
    heads, blocks = canonical["heads"], canonical["blocks"]
    out: dict[str, np.ndarray] = {}
    if layout == "qwen":
        offset = 0.0 if shifted else 1.0
        for key, name in QWEN_HEAD_NAMES.items():
            out[name] = _stored(key, heads[0][key], offset)
        for i, block in enumerate(blocks):
            for key, value in block.items():
                out[f"mtp.layers.{i}.{key}.weight"] = _stored(key, value, offset)
        return out
    if layout != "deepseek":
        raise ValueError(f"unknown layout {layout!r}")
    for k, block in enumerate(blocks):
        p = f"model.layers.{first_layer + k}."
        head = heads[k % len(heads)]
        for key, name in DEEPSEEK_HEAD_NAMES.items():
            out[p + name] = head[key]
        for key, value in block.items():
            out[f"{p}{key}.weight"] = value
    return out


def write_mtp(
    target_path: str | Path,
    tensors: dict[str, np.ndarray],
    layout: str,
    num_layers: int,
    folder: str | Path | None = None,
    shifted: bool = False,
    config_updates: dict | None = None,
    count: int | None | str = "auto",
    text_config: bool = False,
) -> Path:
    """Write MTP tensors into the target's own ``model.safetensors`` (``folder`` None) or into
    ``folder`` (config.json + model.safetensors). ``count``: the layer-count value to write
    ("auto" = ``num_layers``; None leaves the key out). Returns the folder holding the weights."""
    from safetensors.numpy import load_file, save_file

    target_path = Path(target_path)
    key = "mtp_num_hidden_layers" if layout == "qwen" else "num_nextn_predict_layers"
    value = num_layers if count == "auto" else count
    if folder is None:
        weights = target_path / "model.safetensors"
        state = load_file(str(weights))
        state.update(tensors)
        save_file(state, str(weights), metadata={"format": "pt"})
        config = target_config(target_path)
        path = target_path
    else:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        save_file(dict(tensors), str(path / "model.safetensors"), metadata={"format": "mlx" if shifted else "pt"})
        config = {k: v for k, v in target_config(target_path).items() if k not in ("architectures", "auto_map")}
    config.update(config_updates or {})
    if value is not None:
        if text_config:
            config.setdefault("text_config", {})[key] = value
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def build_tiny_mtp(
    target_path: str | Path,
    layout: str = "qwen",
    folder: str | Path | None = None,
    num_layers: int = 1,
    seed: int = 0,
    scale: float = 1.0,
    shifted: bool = False,
    gated: bool = False,
    canonical: dict | None = None,
    passthrough: float = 0.0,
) -> Path:
    """Random MTP weights in ``layout``, in the target folder or in ``folder``."""
    tcfg = target_config(target_path)
    heads = 1 if layout == "qwen" else num_layers
    canonical = canonical or canonical_mtp(target_path, num_layers, seed, scale, gated, num_heads=heads, passthrough=passthrough)
    tensors = mtp_tensors(canonical, layout, tcfg["num_hidden_layers"], shifted)
    updates = {"attn_output_gate": True} if gated else {}
    return write_mtp(target_path, tensors, layout, num_layers, folder, shifted, updates)


def copy_target(source: str | Path, dest: str | Path) -> Path:
    """A fresh copy of a target folder (MTP weights written into it do not leak between tests)."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    return dest


# -- bigram pair ---------------------------------------------------------------------------
def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def build_bigram_target(path: str | Path, cycle_length: int = 32, seed: int = 0, layer_scale: float = 1e-3,
                        first_token: int = 100, head_scale: float = 8.0, family: str = "qwen3",
                        **family_args) -> tuple[Path, list[int]]:
    """A target (``family``: qwen3, or one of :func:`build_family_target`'s, which gets
    ``family_args`` such as ``hybrid``) whose greedy next token after ``cycle[i]`` is
    ``cycle[i + 1]`` (cyclic).

    The attention, Gated DeltaNet and MLP output projections (experts included) are scaled by ``layer_scale``
    (the residual stream stays close to the token embedding, with a small context-dependent
    part), and the LM-head row of ``f(x)`` is ``head_scale`` times the unit embedding of x, so
    argmax(head(norm(E[x]))) = f(x); the logit of f(x) is about ``head_scale * sqrt(hidden_size)``
    (smaller: softer rows).
    """
    from safetensors.numpy import load_file, save_file

    from speculant.testing.tiny import build_tiny_target
    from speculant.testing.tiny_mtp_families import build_family_target

    path = build_tiny_target(path, seed=seed) if family == "qwen3" else build_family_target(path, family, seed=seed, **family_args)
    rng = np.random.default_rng(seed + 11)
    tokens = first_token + rng.permutation(cycle_length)
    cycle = [int(t) for t in tokens]
    file = path / "model.safetensors"
    state = load_file(str(file))
    for name in state:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")) and ".visual." not in name:
            state[name] = (state[name] * layer_scale).astype(np.float32)
    emb = state[embedding_name(state)]
    head = np.zeros_like(state["lm_head.weight"])
    for i, x in enumerate(cycle):
        head[cycle[(i + 1) % cycle_length]] = _unit_rows(emb[x]) * head_scale
    state["lm_head.weight"] = head
    save_file(state, str(file), metadata={"format": "pt"})
    return path, cycle


def successor_map(target_path: str | Path, cycle: list[int], shift: int) -> np.ndarray:
    """The [H, H] matrix sending the RMS-normalised embedding of ``cycle[i]`` to that of
    ``cycle[i + shift]`` (exact on the cycle, which spans fewer than H dimensions)."""
    from safetensors.numpy import load_file

    state = load_file(str(Path(target_path) / "model.safetensors"))
    emb = state[embedding_name(state)].astype(np.float64)
    rows = emb[cycle]
    rms = np.sqrt((rows**2).mean(-1, keepdims=True))
    a = (rows / rms).T  # [H, m]
    b = np.roll(rows / rms, -shift, axis=0).T
    return (b @ np.linalg.pinv(a)).astype(np.float32)


def bigram_mtp(target_path: str | Path, cycle: list[int], path: str = "token", shift: int | None = None,
               num_layers: int = 1, seed: int = 0, block_scale: float = 1e-3) -> dict:
    """Canonical MTP weights that predict x_{t+2} = f(f(x_t)) exactly.

    ``path="token"``: fc = [M, 0] with M = successor_map(shift=0) (the identity on the cycle):
    the output points at E[x_{t+1}], which the head maps to f(x_{t+1}). ``path="hidden"``:
    fc = [0, successor_map(shift=1)] on h_t ~ E[x_t]. A different ``shift`` builds an MTP that is
    off by one on purpose. Block weights are random times ``block_scale``; norm gains are 1.
    """
    correct = 0 if path == "token" else 1
    m = successor_map(target_path, cycle, correct if shift is None else shift)
    canonical = canonical_mtp(target_path, num_layers, seed, scale=block_scale, num_heads=1, norm_jitter=0.0)
    H = m.shape[0]
    zero = np.zeros((H, H), dtype=np.float32)
    canonical["heads"][0]["proj"] = np.concatenate([m, zero] if path == "token" else [zero, m], axis=1)
    return canonical
