"""MTP layers on PyTorch: lean Qwen3-style modules, a per-layer KV cache, and the loader.

One step: ``proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])`` (embedding half first) -> one
decoder block with its own KV cache -> final norm; the target's LM head makes the logits.
Norms compute x̂·(offset + w) with the offset fixed at load time (1 for raw Qwen3-Next/3.5
weights, 0 otherwise); the stored weights are never modified, so nothing is shifted twice.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speculant.core.checkpoint import safetensors_files
from speculant.core.errors import CheckpointError
from speculant.drafters.mtp.config import MTPConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (self.offset + self.weight.float())).to(x.dtype)


def inverse_frequencies(cfg: MTPConfig) -> torch.Tensor:
    """Default RoPE over the first ``head_dim * partial_rotary_factor`` dims (float32)."""
    dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rotary_dim] (NeoX halves)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading ``cos.shape[-1]`` dims of ``x`` [heads, n, hd]; the rest pass through."""
    dim = cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class LayerCache:
    """Growable keys/values [kv_heads, length, hd] with their absolute positions."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        need = self.length + k.shape[1]
        if self.k is None or need > self.k.shape[1]:
            cap = max(need, 2 * (0 if self.k is None else self.k.shape[1]), 64)
            nk = k.new_empty((k.shape[0], cap, k.shape[2]))
            nv = v.new_empty((v.shape[0], cap, v.shape[2]))
            npos = pos.new_empty((cap,))
            if self.length:
                nk[:, : self.length], nv[:, : self.length], npos[: self.length] = self.keys, self.values, self.positions
            self.k, self.v, self.pos = nk, nv, npos
        self.k[:, self.length : need], self.v[:, self.length : need], self.pos[self.length : need] = k, v, pos
        self.length = need
        return self.keys, self.values, self.positions

    @property
    def keys(self) -> torch.Tensor:
        return self.k[:, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.v[:, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self.pos[: self.length]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


class Attention(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.gated = cfg.attn_output_gate
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.heads * hd * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x, cos, sin, positions, cache: LayerCache) -> torch.Tensor:
        n, hd = x.shape[0], self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.gated:  # Qwen3-Next: per head [query (hd), gate (hd)]
            q = q.view(n, self.heads, 2 * hd)
            q, gate = q[..., :hd], q[..., hd:].reshape(n, self.heads * hd)
        q = self.q_norm(q.reshape(n, self.heads, hd)).transpose(0, 1)
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, hd)).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, hd).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys, values, key_pos = cache.append(k, v, positions)
        # a single row always comes after every cached position; several rows need causality
        mask = None if n == 1 else key_pos[None, :] <= positions[:, None]
        groups = self.heads // self.kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=0)
            values = values.repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0 / math.sqrt(hd))
        out = out.transpose(0, 1).reshape(n, self.heads * hd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, positions, cache: LayerCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPModel(nn.Module):
    """All MTP layers; the Qwen layout shares one projection and one set of head norms."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        heads = 1 if cfg.shared_projection else cfg.num_layers
        self.enorm = nn.ModuleList(RMSNorm(H, eps, off) for _ in range(heads))
        self.hnorm = nn.ModuleList(RMSNorm(H, eps, off) for _ in range(heads))
        self.proj = nn.ModuleList(nn.Linear(2 * H, H, bias=False) for _ in range(heads))
        self.norm = nn.ModuleList(RMSNorm(H, eps, off) for _ in range(heads))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.inv_freq = inverse_frequencies(cfg)  # float32, deliberately not a buffer: .to(dtype) must not round it

    def step(self, layer: int, embedded, hidden, positions, cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        i = 0 if self.cfg.shared_projection else layer
        z = self.proj[i](torch.cat([self.enorm[i](embedded), self.hnorm[i](hidden)], dim=-1))
        cos, sin = rope_tables(self.inv_freq, positions, z.dtype)
        z = self.blocks[layer](z, cos, sin, positions, cache)
        return z, self.norm[i](z)


class TorchMTPNetwork:
    """:class:`~speculant.drafters.mtp.drafter.MTPNetwork` on PyTorch, bound to a target."""

    def __init__(self, model: MTPModel, target, backend) -> None:
        self.model = model
        self.cfg = model.cfg
        self.target = target
        self.device = backend._device
        self.dtype = next(model.parameters()).dtype
        self.caches = [LayerCache() for _ in range(self.cfg.num_layers)]

    def reset(self) -> None:
        self.caches = [LayerCache() for _ in range(self.cfg.num_layers)]

    @torch.inference_mode()
    def run(self, layer: int, hidden, token_ids, positions: Sequence[int]):
        embedded = self.target.embed(token_ids).to(self.dtype)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        return self.model.step(layer, embedded, hidden.to(self.dtype), pos, self.caches[layer])

    def cache_length(self, layer: int) -> int:
        return self.caches[layer].length

    def crop(self, layer: int, length: int) -> None:
        self.caches[layer].crop(length)

    @torch.inference_mode()
    def logits(self, hidden) -> torch.Tensor:
        return self.target.lm_head(hidden).float()


def read_mtp_tensors(cfg: MTPConfig) -> dict[str, torch.Tensor]:
    """Only the MTP tensors (renamed to module parameters), never the rest of a target folder."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(cfg.weights_path):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                if name in cfg.names:
                    state[cfg.names[name]] = fh.get_tensor(name)
    return state


def build_model(cfg: MTPConfig, state: dict[str, torch.Tensor]) -> MTPModel:
    """Strict load: every parameter present with its shape, nothing else."""
    model = MTPModel(cfg)
    own = model.state_dict()
    problems = [f"missing tensor for {k}" for k in own if k not in state]
    problems += [f"tensor for {k} has shape {list(state[k].shape)}, expected {list(own[k].shape)}"
                 for k in own if k in state and state[k].shape != own[k].shape]
    if problems:
        raise CheckpointError(f"{cfg.weights_path}: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)
    return model


def load_torch_network(cfg: MTPConfig, backend, target) -> TorchMTPNetwork:
    model = build_model(cfg, read_mtp_tensors(cfg))
    model.to(device=backend._device, dtype=backend.dtype).eval().requires_grad_(False)
    model.inv_freq = model.inv_freq.to(backend._device)
    return TorchMTPNetwork(model, target, backend)
