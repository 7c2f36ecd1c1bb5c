"""DFlash draft model on PyTorch: config -> modules -> forward, then the Drafter around it.

The draft reads the target's hidden states of ``target_layer_ids``, projects them once
(``fc`` + ``hidden_norm``) into a context injected as extra keys/values into every layer,
and denoises a block ``[anchor, mask x (B-1)]`` in one non-causal pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speculant.core.interfaces import Drafter
from speculant.core.types import Draft, DrafterInfo, DraftRequest, ForwardOutput
from speculant.drafters.dflash import muse_glimmer
from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.visibility import every_key_visible


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """RoPE tables computed with transformers' own init functions, so any rope_type matches the target."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = Qwen3Config(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                         max_position_embeddings=cfg.max_position_embeddings or 32768, rope_parameters=dict(cfg.rope))
        rope_type = cfg.rope.get("rope_type", "default")
        if rope_type == "default":
            base = float(cfg.rope["rope_theta"])
            inv_freq = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
            scale = 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = scale
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :].to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def span(self, start: int, count: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions ``start .. start + count - 1``: slices of tables kept for every
        position seen so far (doubling as they grow), equal to :meth:`forward` element for
        element. Decoding asks for two short spans per round; recomputing them was ~20 ops."""
        end = start + count
        tables = self._tables
        if tables is None or tables[0].shape[0] < end or tables[0].dtype != dtype or tables[0].device != device:
            size = max(256, 1 << (end - 1).bit_length())
            tables = self._tables = self(torch.arange(size, device=device), dtype)
        return tables[0][start:end], tables[1][start:end]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to ``x`` [heads, n, hd] with tables [n, hd] (NeoX half rotation)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values [kv_heads, n, hd] for rows ``x`` [n, H]."""
        n = x.shape[0]
        k = self.k_norm(self.k_proj(x).view(n, self.kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        return rotate(k, cos, sin), v

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        """``context`` (:class:`ContextRows` or a :class:`ContextCache` slot) puts the block's keys
        and values after the context's."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.heads, self.head_dim)).transpose(0, 1)
        q = rotate(q, cos, sin)
        k, v = context.join(*self.keys_values(x, cos, sin))
        groups = self.heads // self.kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=0)
            v = v.repeat_interleave(groups, dim=0)
        # one dtype for all three: under bf16 autocast rotated q/k come out float32 while v is
        # bf16, and autocast does not reach into torch.func.vmap (DFlash2's blockwise training)
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask,
                                             scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(0, 1).reshape(n, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.causal = cfg.layer_is_causal(index)
        self.window = cfg.layer_window(index)

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """The draft network; tensor names match the published checkpoints."""

    layer_class: type[nn.Module] = DecoderLayer  # DFlash2 swaps in layers with convolutions

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))


def attention_mask(ctx_start: int, ctx_length: int, block_start: int, block_length: int, causal: bool,
                   window: int | None, device=None) -> torch.Tensor | None:
    """Boolean keep-mask [block, ctx + block] for context rows at ``ctx_start ..`` followed by
    block rows at ``block_start ..``, or None when every key is visible."""
    if every_key_visible(ctx_start, block_start, block_length, causal, window):
        return None
    queries = torch.arange(block_start, block_start + block_length, device=device)
    keys = torch.cat([torch.arange(ctx_start, ctx_start + ctx_length, device=device), queries])
    rel = queries[:, None] - keys[None, :]  # query - key
    keep = torch.ones_like(rel, dtype=torch.bool)
    if causal:
        keep &= rel >= 0
    if window is not None:
        keep &= rel < window
        if not causal:
            keep &= rel > -window
    return keep


class ContextRows(NamedTuple):
    """Context keys/values [kv_heads, n, hd] held apart from the block's (training)."""

    keys: torch.Tensor
    values: torch.Tensor

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)


class ContextCache:
    """Per-layer keys/values of committed context rows, in buffers with room after them: a draft
    writes its block's rows there (never committed) and attends over a view, so no cycle copies
    the context. A sliding layer keeps its last ``window - 1`` rows; its buffer is compacted only
    when full, so that copy is paid once per ``window`` rows, not once per cycle."""

    def __init__(self, num_layers: int, windows: list[int | None]) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.first = [0] * num_layers  # buffer row of the first kept context row
        self.end = [0] * num_layers  # buffer row after the last committed one
        self.starts: list[int] = [0] * num_layers  # absolute position of the first kept row
        self.windows = windows

    def append(self, layer: int, k, v, start: int, reserve: int = 0) -> None:
        """Commit rows ``k``/``v`` [kv_heads, n, hd] (positions from ``start`` on); keep room for
        ``reserve`` block rows after them."""
        if self.keys[layer] is None:
            self.starts[layer] = start
        n = k.shape[1]
        self._make_room(layer, n + reserve, k, v)
        end = self.end[layer]
        self.keys[layer][:, end:end + n] = k
        self.values[layer][:, end:end + n] = v
        self.end[layer] = end + n
        window = self.windows[layer]
        if window is not None and self.length(layer) > window - 1:  # a sliding layer never needs more
            drop = self.length(layer) - (window - 1)
            self.first[layer] += drop
            self.starts[layer] += drop

    def _make_room(self, layer: int, rows: int, k, v) -> None:
        keys, first, end = self.keys[layer], self.first[layer], self.end[layer]
        kept = end - first
        if keys is not None and end + rows <= keys.shape[1]:
            return
        window = self.windows[layer]
        need = kept + rows
        capacity = max(64, 2 * need if window is None else need + window)
        grown_k = k.new_empty((k.shape[0], capacity, k.shape[2]))
        grown_v = v.new_empty((v.shape[0], capacity, v.shape[2]))
        if kept:
            grown_k[:, :kept] = keys[:, first:end]
            grown_v[:, :kept] = self.values[layer][:, first:end]
        self.keys[layer], self.values[layer] = grown_k, grown_v
        self.first[layer], self.end[layer] = 0, kept

    def length(self, layer: int) -> int:
        return self.end[layer] - self.first[layer]

    def slot(self, layer: int) -> "_BlockSlot":
        return _BlockSlot(self, layer)


class _BlockSlot:
    """One layer's context in a :class:`ContextCache`, joined with a block in place."""

    def __init__(self, cache: ContextCache, layer: int) -> None:
        self.cache, self.layer = cache, layer

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, i = self.cache, self.layer
        first, end = c.first[i], c.end[i]
        c.keys[i][:, end:end + k.shape[1]] = k
        c.values[i][:, end:end + v.shape[1]] = v
        return c.keys[i][:, first:end + k.shape[1]], c.values[i][:, first:end + v.shape[1]]


def embedding_rows(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's embedding table rows for ``ids``, without the weightless ``embed_norm`` a
    Muse Glimmer embedding applies on lookup: transformers' DFlash generation bypasses it for
    the block's rows, so the assistant was trained on bare rows."""
    module = target.model.get_input_embeddings()
    return F.embedding(ids, module.weight)


class TorchDFlashDrafter(Drafter):
    """Drafter protocol over :class:`DFlashModel`, borrowing the target's embedding and head."""

    def __init__(self, model: DFlashModel, info: DrafterInfo, target, backend) -> None:
        self.model = model
        self.cfg = model.cfg
        self.info = info
        self.target = target
        self.backend = backend
        self.cache: ContextCache | None = None
        self.pending: list[torch.Tensor] = []
        self.context_length = 0
        self._dtype = next(model.parameters()).dtype
        # a Muse Glimmer assistant reading the target's last layer gets its final-normed state
        self._final_feature = muse_glimmer.final_feature(self.cfg) if info.final_hidden == "post_norm" else None

    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        self.cache = ContextCache(self.cfg.num_hidden_layers, [l.window for l in self.model.layers])
        self.pending = [self._features(output, None)]
        self.context_length = 0

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        self.pending.append(self._features(output, num_rows))

    def _features(self, output: ForwardOutput, rows: int | None) -> torch.Tensor:
        features = output.features[:rows]
        j = self._final_feature
        if j is None:
            return features
        H = self.cfg.hidden_size
        features = features.clone()
        features[:, j * H:(j + 1) * H] = output.final_hidden[:rows]
        return features

    @torch.inference_mode()
    def _hidden(self, request: DraftRequest) -> torch.Tensor:
        """Final-normed draft hidden states of block rows 1..k."""
        m, cfg = self.model, self.cfg
        k = request.num_tokens
        features = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        self.pending = []
        n_ctx = features.shape[0]
        device = features.device
        dtype = self._dtype
        ctx = m.project_context(features.to(dtype))
        ctx_cos, ctx_sin = m.rotary.span(self.context_length, n_ctx, dtype, device)
        cos, sin = m.rotary.span(request.position, k + 1, dtype, device)
        ids = self._block_ids(request.anchor_id, k)
        x = self._embed(ids).to(dtype)
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        cache = self.cache
        for i, layer in enumerate(m.layers):
            ck, cv = layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin)
            cache.append(i, ck, cv, self.context_length, reserve=k + 1)
            mask = attention_mask(cache.starts[i], cache.length(i), request.position, k + 1, layer.causal,
                                  layer.window, device)
            x = layer(x, cos, sin, cache.slot(i), mask)
        self.context_length += n_ctx
        return m.norm(x[1:])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.is_muse_glimmer:
            return embedding_rows(self.target, ids)
        return self.target.embed(ids)

    def _block_ids(self, anchor: int, k: int) -> torch.Tensor:
        ids = self.backend.int_array([anchor] + [self.cfg.mask_token_id] * k)
        return ids

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.to(self.backend.dtype)  # a quantized draft may compute in another dtype
        # the bare head, as the published drafts and the trainer use it: target.lm_head includes the target's own
        # logit transform (Gemma's soft-cap, Muse Glimmer's), which a draft's multiplier / soft-cap would repeat
        logits = self.target.model.get_output_embeddings()(hidden).float()
        if self.cfg.is_muse_glimmer:  # transformers' DFlash drafts with the bare head alone
            return logits
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Draft:
        logits = self.logits(self._hidden(request))
        tokens = torch.argmax(logits, dim=-1)
        return Draft(token_ids=tokens, num_tokens=request.num_tokens)
