"""MTP layers on PyTorch: lean modules, a per-layer KV cache, and the loader.

One step: ``proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])`` (embedding half first) -> one
decoder block with its own KV cache -> final norm; the target's LM head makes the logits.
Norms compute x̂·(offset + w) with the offset fixed at load time (1 for raw Qwen3-Next/3.5
weights, 0 otherwise); the stored weights are never modified, so nothing is shifted twice.

A block is attention (Qwen3-style q/k/v, or DeepSeek MLA, whose cache keeps the expanded
per-head keys and values) then an MLP (dense SwiGLU, or mixture-of-experts routed by
:mod:`speculant.drafters.mtp.routing`). Experts are stored packed, gate_up [E, 2I, H] and
down [E, H, I]; per-expert checkpoints are stacked at load time.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speculant.core.checkpoint import require_float_tensors, safetensors_files
from speculant.core.errors import CheckpointError
from speculant.drafters.mtp.config import MTPConfig, rope_frequencies
from speculant.drafters.mtp.tensors import assemble, wanted_tensors
from speculant.drafters.mtp.routing import route

LATENT_NORM_EPS = 1e-6  # MLA's q_a / kv_a norms use the RMSNorm default, not rms_norm_eps


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
    """RoPE over the first ``cfg.rope_dim`` dims (float32): default, or YaRN's from the host."""
    if cfg.rope["rope_type"] == "yarn":
        return torch.from_numpy(rope_frequencies(cfg)[0])
    dim = cfg.rope_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, rotary_dim] (NeoX halves), times YaRN's attention factor ``scale``."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


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

    def attend(self, q, k, v, positions, scale: float) -> torch.Tensor:
        """Appends k / v [kv_heads, n, d]; causal attention of q [heads, n, d] over the cache,
        returned as [n, heads, dv] (``torch_rows.RowsCache`` does the same for many sequences)."""
        keys, values, key_pos = self.append(k, v, positions)
        # a single row always comes after every cached position; several rows need causality
        keep = None if q.shape[1] == 1 else key_pos[None, :] <= positions[:, None]
        return attention(q, keys, values, keep, scale).transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.gated = cfg.attn_output_gate
        self.scale = cfg.softmax_scale
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
        out = cache.attend(q, k, v, positions, self.scale).reshape(n, self.heads * hd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


def attention(q, keys, values, keep: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [..., heads, n, d] over keys / values [..., kv_heads, length, d] (grouped heads
    repeated) where ``keep`` (broadcast to [..., n, length]) holds; returns [..., heads, n, dv]."""
    groups = q.shape[-3] // keys.shape[-3]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=-3)
        values = values.repeat_interleave(groups, dim=-3)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=keep, scale=scale)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rotary pairs (x0, x1), (x2, x3)... to halves [x0, x2, ...; x1, x3, ...]
    (applied to queries and keys alike, so scores are those of pairwise rotation)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek multi-head latent attention; the cache keeps expanded per-head keys and values."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        m, H, bias = cfg.mla, cfg.hidden_size, cfg.attention_bias
        self.heads, self.m, self.interleave, self.scale = cfg.num_attention_heads, m, cfg.rope_interleave, cfg.softmax_scale
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(H, self.heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, cfg.norm_offset)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, cfg.norm_offset)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * m.v_head_dim, H, bias=bias)

    def forward(self, x, cos, sin, positions, cache: LayerCache) -> torch.Tensor:
        n, m, nh = x.shape[0], self.m, self.heads
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(n, nh, m.qk_head_dim).transpose(0, 1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(n, nh, m.qk_nope_head_dim + m.v_head_dim).transpose(0, 1)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rot = k_rot[None]  # one rotary key shared by every head
        if self.interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q = torch.cat([q_nope, rotate(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_nope, rotate(k_rot, cos, sin).expand(nh, n, m.qk_rope_head_dim)], dim=-1)
        out = cache.attend(q, k, v.contiguous(), positions, self.scale)
        return self.o_proj(out.reshape(n, nh * m.v_head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TorchRouterOps:
    """:class:`~speculant.drafters.mtp.routing.RouterOps` on PyTorch."""

    softmax = staticmethod(lambda x: torch.softmax(x, dim=-1))
    sigmoid = staticmethod(torch.sigmoid)
    top_k = staticmethod(lambda x, k: torch.topk(x, k, dim=-1).indices)
    take = staticmethod(lambda x, i: torch.gather(x, -1, i))
    min = staticmethod(lambda x: x.amin(dim=-1, keepdim=True))
    sum = staticmethod(lambda x: x.sum(dim=-1, keepdim=True))
    where = staticmethod(torch.where)


class Router(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.spec = cfg.moe
        self.weight = nn.Parameter(torch.zeros(cfg.moe.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.moe.num_experts)) if cfg.moe.scoring == "sigmoid" else None

    def forward(self, x: torch.Tensor):
        logits = F.linear(x.float(), self.weight.float())
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return route(TorchRouterOps, logits, self.spec, bias)


class Experts(nn.Module):
    """Packed SwiGLU experts; each row runs through its k chosen experts only."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        E, H, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, inter))

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(indices).tolist():
            rows, slot = torch.nonzero(indices == e, as_tuple=True)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        m = cfg.moe
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = MLP(cfg.hidden_size, m.shared_intermediate_size) if m.shared_intermediate_size else None
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if m.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        indices, weights = self.gate(x)
        out = self.experts(x, indices, weights)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out


class Block(nn.Module):
    def __init__(self, cfg: MTPConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = LatentAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

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
        self.blocks = nn.ModuleList(Block(cfg, k) for k in range(cfg.num_layers))
        self.inv_freq = inverse_frequencies(cfg)  # float32, deliberately not a buffer: .to(dtype) must not round it
        self.rope_scale = rope_frequencies(cfg)[1]  # YaRN attention factor on cos/sin (1 otherwise)

    def step(self, layer: int, embedded, hidden, positions, cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
        i = 0 if self.cfg.shared_projection else layer
        z = self.proj[i](torch.cat([self.enorm[i](embedded), self.hnorm[i](hidden)], dim=-1))
        cos, sin = rope_tables(self.inv_freq, positions, z.dtype, self.rope_scale)
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

    def fork(self) -> "TorchMTPNetwork":
        other = copy.copy(self)
        other.reset()
        return other

    @torch.inference_mode()
    def run(self, layer: int, hidden, token_ids, positions: Sequence[int]):
        return self._step(layer, hidden, token_ids, positions, self.caches[layer])

    @torch.inference_mode()
    def run_rows(self, nets: Sequence["TorchMTPNetwork"], layer: int, hidden, token_ids, positions: Sequence[int]):
        """:meth:`run` of row r for fork ``nets[r]`` (eager forks over this model), all in one step."""
        from speculant.drafters.mtp.torch_rows import RowsCache

        return self._step(layer, hidden, token_ids, positions, RowsCache([n.caches[layer] for n in nets]))

    def _step(self, layer: int, hidden, token_ids, positions: Sequence[int], cache):
        embedded = self.target.embed(token_ids).to(self.dtype)
        pos = torch.tensor(list(positions), dtype=torch.long, device=self.device)
        return self.model.step(layer, embedded, hidden.to(self.dtype), pos, cache)

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

    wanted = wanted_tensors(cfg)
    require_float_tensors(cfg.weights_path, wanted)
    raw: dict[str, torch.Tensor] = {}
    for file in safetensors_files(cfg.weights_path):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                if name in wanted:
                    raw[name] = fh.get_tensor(name)
    return assemble(raw, cfg, torch.stack, lambda parts: torch.cat(parts, dim=0))


def build_model(cfg: MTPConfig, state: dict[str, torch.Tensor]) -> MTPModel:
    """Strict load: every parameter present with its shape, nothing else."""
    model = MTPModel(cfg)
    own = dict(model.named_parameters())
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
    network = TorchMTPNetwork(model, target, backend)
    network.fast_path = target.prepare_draft(model) or "eager"  # packed where the target is
    return network
