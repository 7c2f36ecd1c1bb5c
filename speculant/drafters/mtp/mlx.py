"""MTP layers on MLX: the same math as :mod:`speculant.drafters.mtp.torch`.

``proj(cat[enorm(embed(x_{t+1})), hnorm(h_t)])`` -> one decoder block with its own KV cache ->
final norm; the target's LM head makes the logits. Norms compute x̂·(offset + w) in float32
with the offset fixed at load time; the stored weights are never shifted. RoPE is
``mx.fast.rope`` over the first ``cfg.rope_dim`` dims (NeoX halves; DeepSeek MLA: interleaved
pairs, ``traditional``), with YaRN's host-computed frequencies when configured, which needs
contiguous positions per call; the drafting lifecycle only makes such calls.

MLA caches the expanded per-head keys and values; mixture-of-experts blocks route with
:mod:`speculant.drafters.mtp.routing` and run the k chosen experts per row with ``mx.gather_mm``
over packed gate_up [E, 2I, H] / down [E, H, I] weights.
"""

from __future__ import annotations

import copy
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from speculant.core.checkpoint import safetensors_files
from speculant.core.errors import CheckpointError
from speculant.drafters.mtp.config import MTPConfig, rope_frequencies
from speculant.drafters.mtp.mlx_cache import LayerCache
from speculant.drafters.mtp.tensors import assemble, wanted_tensors
from speculant.drafters.mtp.routing import route

LATENT_NORM_EPS = 1e-6  # MLA's q_a / kv_a norms use the RMSNorm default, not rms_norm_eps


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


class RoPE:
    """``mx.fast.rope`` over the first ``cfg.rope_dim`` dims, YaRN frequencies and factor included."""

    def __init__(self, cfg: MTPConfig, traditional: bool = False) -> None:
        self.dims, self.traditional = cfg.rope_dim, traditional
        self.base, self.freqs, self.scale = cfg.rope_theta, None, 1.0
        if cfg.rope["rope_type"] == "yarn":
            inv_freq, self.scale = rope_frequencies(cfg)
            self.base, self.freqs = None, mx.array(1.0 / inv_freq)

    def __call__(self, x: mx.array, offset: int | mx.array) -> mx.array:
        out = mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=1.0, offset=offset, freqs=self.freqs)
        return out if self.scale == 1.0 else out * self.scale


def attend(q: mx.array, keys: mx.array, values: mx.array, cache, positions: list[int], scale: float) -> mx.array:
    """Attention of q (``cache.heads`` layout) over ``keys`` / ``values`` under the cache's mask; returns [n, heads, dv]."""
    return cache.rows(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=cache.mask(positions)))


class Attention(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.gated = cfg.attn_output_gate
        self.rope = RoPE(cfg)
        self.scale = cfg.softmax_scale
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.heads * hd * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, cfg.norm_offset)

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
        offset = cache.start(positions)
        q, k = self.rope(cache.heads(q), offset), self.rope(cache.heads(k), offset)
        v = cache.heads(self.v_proj(x).reshape(n, self.kv_heads, hd))
        keys, values = cache.append(k, v, positions)
        out = attend(q, keys, values, cache, positions, self.scale).reshape(n, self.heads * hd)
        if gate is not None:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out)


class LatentAttention(nn.Module):
    """DeepSeek multi-head latent attention; the cache keeps expanded per-head keys and values."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        m, H, bias = cfg.mla, cfg.hidden_size, cfg.attention_bias
        self.heads, self.m, self.scale = cfg.num_attention_heads, m, cfg.softmax_scale
        self.rope = RoPE(cfg, traditional=cfg.rope_interleave)
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

    def __call__(self, x: mx.array, positions: list[int], cache: LayerCache) -> mx.array:
        n, m, nh = x.shape[0], self.m, self.heads
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = cache.heads(q.reshape(n, nh, m.qk_head_dim))
        q_nope, q_rot = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        kv_a = self.kv_a_proj_with_mqa(x)
        latent, k_rot = kv_a[:, : m.kv_lora_rank], kv_a[:, m.kv_lora_rank:]
        kv = cache.heads(self.kv_b_proj(self.kv_a_layernorm(latent)).reshape(n, nh, m.qk_nope_head_dim + m.v_head_dim))
        k_nope, v = kv[..., : m.qk_nope_head_dim], kv[..., m.qk_nope_head_dim:]
        offset = cache.start(positions)
        k_rot = self.rope(cache.heads(k_rot[:, None]), offset)  # one rotary key shared by every head
        q = mx.concatenate([q_nope, self.rope(q_rot, offset)], axis=-1)
        k = mx.concatenate([k_nope, mx.broadcast_to(k_rot, (*k_nope.shape[:-1], m.qk_rope_head_dim))], axis=-1)
        keys, values = cache.append(k, v, positions)
        out = attend(q, keys, values, cache, positions, self.scale)
        return self.o_proj(out.reshape(n, nh * m.v_head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MLXRouterOps:
    """:class:`~speculant.drafters.mtp.routing.RouterOps` on MLX."""

    softmax = staticmethod(lambda x: mx.softmax(x, axis=-1, precise=True))
    sigmoid = staticmethod(mx.sigmoid)
    top_k = staticmethod(lambda x, k: mx.argpartition(-x, kth=k - 1, axis=-1)[..., :k])
    take = staticmethod(lambda x, i: mx.take_along_axis(x, i, axis=-1))
    min = staticmethod(lambda x: x.min(axis=-1, keepdims=True))
    sum = staticmethod(lambda x: x.sum(axis=-1, keepdims=True))
    where = staticmethod(mx.where)


class Router(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        self.spec = cfg.moe
        self.weight = mx.zeros((cfg.moe.num_experts, cfg.hidden_size))
        if cfg.moe.scoring == "sigmoid":
            self.e_score_correction_bias = mx.zeros((cfg.moe.num_experts,))

    def __call__(self, x: mx.array):
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        bias = self.get("e_score_correction_bias")
        return route(MLXRouterOps, logits, self.spec, None if bias is None else bias.astype(mx.float32))


class Experts(nn.Module):
    """Packed SwiGLU experts; each row runs through its k chosen experts only (``mx.gather_mm``)."""

    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        E, H, inter = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
        self.gate_up_proj = mx.zeros((E, 2 * inter, H))
        self.down_proj = mx.zeros((E, H, inter))

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        rows = x[:, None, None, :]  # [n, 1, 1, H] against experts indices [n, k]
        gate, up = mx.split(mx.gather_mm(rows, self.gate_up_proj.swapaxes(-1, -2), rhs_indices=indices), 2, axis=-1)
        y = mx.gather_mm(nn.silu(gate) * up, self.down_proj.swapaxes(-1, -2), rhs_indices=indices)[:, :, 0, :]  # [n, k, H]
        return (y * weights[..., None].astype(y.dtype)).sum(axis=1)


class MoE(nn.Module):
    def __init__(self, cfg: MTPConfig) -> None:
        super().__init__()
        m = cfg.moe
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if m.shared_intermediate_size:
            self.shared = MLP(cfg.hidden_size, m.shared_intermediate_size)
        if m.shared_gate:
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.gate(x)
        out = self.experts(x, indices, weights)
        if "shared" in self:
            shared = self.shared(x)
            if "shared_gate" in self:
                shared = mx.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out


class Block(nn.Module):
    def __init__(self, cfg: MTPConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = LatentAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

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
        self.blocks = [Block(cfg, k) for k in range(cfg.num_layers)]

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
        self.fast_path = target.prepare_draft(model) or "eager"  # transposed weights where the target's are
        self.caches = [LayerCache() for _ in range(self.cfg.num_layers)]
        self.compiled = None  # a CompiledMTP (mlx_compiled.py) once compile_steps is called

    def compile_steps(self) -> None:
        """Run the MTP steps compiled (mlx_compiled.py)."""
        from speculant.drafters.mtp.mlx_compiled import COMPILED_ROWS, CompiledMTP

        self.compiled = CompiledMTP(self.model)
        self.fast_path = f"compiled MTP steps (mx.compile per layer, up to {COMPILED_ROWS} rows)" + \
            ("" if self.fast_path == "eager" else f"; {self.fast_path.removeprefix('eager; ')}")

    def reset(self) -> None:
        self.caches = [LayerCache() for _ in range(self.cfg.num_layers)]
        if self.compiled is not None:
            self.compiled.reset()

    def fork(self) -> "MLXMTPNetwork":
        other = copy.copy(self)
        if self.compiled is not None:
            other.compiled = self.compiled.fork()
        other.reset()
        return other

    def leave_compiled(self) -> None:
        """Go on eagerly: every position the compiled buffers hold moves to the eager caches, in
        the order held (speculative entries too; the next commit crops them as before)."""
        compiled, self.compiled = self.compiled, None
        self.reset()
        for cache, held, buffers in zip(self.caches, compiled.positions, compiled.buffers):
            if held:
                at = mx.array(held, dtype=mx.int32)
                cache.append(buffers[0][:, :, at], buffers[1][:, :, at], held)

    def run_rows(self, nets: Sequence["MLXMTPNetwork"], layer: int, hidden, token_ids, positions: Sequence[int]):
        """:meth:`run` of row r for fork ``nets[r]`` (eager forks over this model), all in one step."""
        from speculant.drafters.mtp.mlx_rows import RowsCache

        cache = RowsCache([n.caches[layer] for n in nets])
        embedded = self.target.embed(token_ids).astype(self.dtype)
        pre, post = self.model.step(layer, embedded, hidden.astype(self.dtype), [int(p) for p in positions], cache)
        mx.async_eval(pre, post, *cache.buffers())
        return pre, post

    def run(self, layer: int, hidden, token_ids, positions: Sequence[int]):
        positions = [int(p) for p in positions]
        if positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError(f"MLX MTP steps need contiguous positions, got {positions}")
        embedded = self.target.embed(token_ids).astype(self.dtype)
        if self.compiled is not None:
            pre, post = self.compiled.run(layer, embedded, hidden.astype(self.dtype), positions)
            mx.async_eval(pre, post, *self.compiled.arrays(layer))
            return pre, post
        cache = self.caches[layer]
        pre, post = self.model.step(layer, embedded, hidden.astype(self.dtype), positions, cache)
        mx.async_eval(pre, post, cache.k, cache.v)  # keeps the lazy graph of the cache short
        return pre, post

    def cache_length(self, layer: int) -> int:
        return self.caches[layer].length if self.compiled is None else self.compiled.cache_length(layer)

    def crop(self, layer: int, length: int) -> None:
        if self.compiled is None:
            self.caches[layer].crop(length)
        else:
            self.compiled.crop(layer, length)

    def logits(self, hidden) -> mx.array:
        return self.target.lm_head(hidden).astype(mx.float32)


def read_mtp_tensors(cfg: MTPConfig) -> dict[str, mx.array]:
    """Only the MTP tensors (renamed to module parameters), never the rest of a target folder."""
    from speculant.core.checkpoint import read_safetensors_header, require_float_tensors

    wanted = wanted_tensors(cfg)
    require_float_tensors(cfg.weights_path, wanted)
    raw: dict[str, mx.array] = {}
    for file in safetensors_files(cfg.weights_path):
        if wanted.isdisjoint(read_safetensors_header(file)):
            continue
        # mx.load reads bfloat16 (safetensors' numpy path cannot) and only what is evaluated
        raw.update((name, array) for name, array in mx.load(str(file)).items() if name in wanted)
    return assemble(raw, cfg, mx.stack, lambda parts: mx.concatenate(parts, axis=0))


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
    network = MLXMTPNetwork(model, target, backend.dtype)
    if getattr(target, "compiles_whole", False):  # the steps compile where the target's whole forward does
        network.compile_steps()
    return network
