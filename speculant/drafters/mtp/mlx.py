"""MTP layers on MLX: the same math as :mod:`speculant.drafters.mtp.torch`.

``proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])`` -> one decoder block with its own KV cache ->
final norm; the target's LM head makes the logits. Norms compute x̂·(offset + w) in float32
with the offset fixed at load time; the stored weights are never shifted. RoPE is
``mx.fast.rope`` over the first ``head_dim * partial_rotary_factor`` dims (NeoX halves), which
needs contiguous positions per call; the drafting lifecycle only makes such calls.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from speculant.core.checkpoint import safetensors_files
from speculant.core.errors import CheckpointError
from speculant.drafters.mtp.config import MTPConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = mx.full((dim,), 1.0 - offset)
        self.eps = eps
        self.offset = offset

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        xf = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (self.offset + self.weight.astype(mx.float32))).astype(x.dtype)


class LayerCache:
    """Keys/values [1, kv_heads, length, hd] in a buffer grown in steps, positions on the host."""

    step = 256

    def __init__(self) -> None:
        self.k: mx.array | None = None
        self.v: mx.array | None = None
        self.positions: list[int] = []

    @property
    def length(self) -> int:
        return len(self.positions)

    def append(self, k: mx.array, v: mx.array, positions: Sequence[int]):
        start, n = self.length, k.shape[2]
        need = start + n
        if self.k is None or need > self.k.shape[2]:
            cap = ((need + self.step - 1) // self.step) * self.step
            grown_k = mx.zeros((1, k.shape[1], cap, k.shape[3]), dtype=k.dtype)
            grown_v = mx.zeros((1, v.shape[1], cap, v.shape[3]), dtype=v.dtype)
            if start:
                grown_k[:, :, :start] = self.k[:, :, :start]
                grown_v[:, :, :start] = self.v[:, :, :start]
            self.k, self.v = grown_k, grown_v
        self.k[:, :, start:need] = k
        self.v[:, :, start:need] = v
        self.positions.extend(int(p) for p in positions)
        return self.k[:, :, :need], self.v[:, :, :need], self.positions

    def crop(self, length: int) -> None:
        del self.positions[length:]


class Attention(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.gated = cfg.attn_output_gate
        self.rope_dims = int(hd * cfg.partial_rotary_factor)
        self.rope_theta = cfg.rope_theta
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.heads * hd * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        return mx.fast.rope(x, self.rope_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)

    def __call__(self, x: mx.array, positions: list[int], cache: LayerCache) -> mx.array:
        n, hd = x.shape[0], self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.gated:  # Qwen3-Next: per head [query (hd), gate (hd)]
            q = q.reshape(n, self.heads, 2 * hd)
            q, gate = q[..., :hd], q[..., hd:].reshape(n, self.heads * hd)
        q = q.reshape(n, self.heads, hd)
        k = self.k_proj(x).reshape(n, self.kv_heads, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._rope(q.transpose(1, 0, 2)[None], positions[0])
        k = self._rope(k.transpose(1, 0, 2)[None], positions[0])
        v = self.v_proj(x).reshape(n, self.kv_heads, hd).transpose(1, 0, 2)[None]
        keys, values, key_pos = cache.append(k, v, positions)
        mask = None
        if n > 1:  # a single row always comes after every cached position
            mask = mx.array(np.asarray(key_pos)[None, :] <= np.asarray(positions)[:, None])
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=hd ** -0.5, mask=mask)
        out = out[0].transpose(1, 0, 2).reshape(n, self.heads * hd)
        if gate is not None:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg)

    def __call__(self, x: mx.array, positions: list[int], cache: LayerCache) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPModel(nn.Module):
    """All MTP layers; the Qwen layout shares one projection and one set of head norms."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        heads = 1 if cfg.shared_projection else cfg.num_layers
        self.enorm = [RMSNorm(H, eps, off) for _ in range(heads)]
        self.hnorm = [RMSNorm(H, eps, off) for _ in range(heads)]
        self.proj = [nn.Linear(2 * H, H, bias=False) for _ in range(heads)]
        self.norm = [RMSNorm(H, eps, off) for _ in range(heads)]
        self.blocks = [Block(cfg) for _ in range(cfg.num_layers)]

    def step(self, layer: int, embedded: mx.array, hidden: mx.array, positions: list[int], cache: LayerCache):
        i = 0 if self.cfg.shared_projection else layer
        z = self.proj[i](mx.concatenate([self.enorm[i](embedded), self.hnorm[i](hidden)], axis=-1))
        z = self.blocks[layer](z, positions, cache)
        return z, self.norm[i](z)


class MLXMTPNetwork:
    """:class:`~speculant.drafters.mtp.drafter.MTPNetwork` on MLX, bound to a target."""

    def __init__(self, model: MTPModel, target, dtype) -> None:
        self.model = model
        self.cfg = model.cfg
        self.target = target
        self.dtype = dtype
        self.caches = [LayerCache() for _ in range(self.cfg.num_layers)]

    def reset(self) -> None:
        self.caches = [LayerCache() for _ in range(self.cfg.num_layers)]

    def run(self, layer: int, hidden, token_ids, positions: Sequence[int]):
        positions = [int(p) for p in positions]
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError(f"MLX MTP steps need contiguous positions, got {positions}")
        embedded = self.target.embed(token_ids).astype(self.dtype)
        cache = self.caches[layer]
        pre, post = self.model.step(layer, embedded, hidden.astype(self.dtype), positions, cache)
        mx.async_eval(pre, post, cache.k, cache.v)  # keeps the lazy graph of the cache short
        return pre, post

    def cache_length(self, layer: int) -> int:
        return self.caches[layer].length

    def crop(self, layer: int, length: int) -> None:
        self.caches[layer].crop(length)

    def logits(self, hidden) -> mx.array:
        return self.target.lm_head(hidden).astype(mx.float32)


def read_mtp_tensors(cfg: MTPConfig) -> dict[str, mx.array]:
    """Only the MTP tensors (renamed to module parameters), never the rest of a target folder."""
    from safetensors import safe_open

    state: dict[str, mx.array] = {}
    for file in safetensors_files(cfg.weights_path):
        with safe_open(str(file), framework="mlx") as fh:
            for name in fh.keys():
                if name in cfg.names:
                    state[cfg.names[name]] = fh.get_tensor(name)
    return state


def build_model(cfg: MTPConfig, state: dict[str, mx.array]) -> MTPModel:
    """Strict load: every parameter present with its shape, nothing else."""
    from mlx.utils import tree_flatten

    model = MTPModel(cfg)
    own = dict(tree_flatten(model.parameters()))
    problems = [f"missing tensor for {k}" for k in own if k not in state]
    problems += [f"tensor for {k} has shape {list(state[k].shape)}, expected {list(own[k].shape)}"
                 for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if problems:
        raise CheckpointError(f"{cfg.weights_path}: " + "; ".join(problems))
    model.load_weights(list(state.items()), strict=True)
    return model


def load_mlx_network(cfg: MTPConfig, backend, target) -> MLXMTPNetwork:
    model = build_model(cfg, read_mtp_tensors(cfg))
    model.set_dtype(backend.dtype)
    model.eval()
    mx.eval(model.parameters())
    return MLXMTPNetwork(model, target, backend.dtype)
