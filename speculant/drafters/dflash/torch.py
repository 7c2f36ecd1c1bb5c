"""DFlash draft model on PyTorch: config -> modules -> forward, then the network the shared
:class:`~speculant.drafters.dflash.drafter.DFlashDrafter` drives.

The draft reads the target's hidden states of ``target_layer_ids``, projects them once
(``fc`` + ``hidden_norm``) into a context injected as extra keys/values into every layer,
and denoises a block ``[anchor, mask x (B-1)]`` in one non-causal pass.
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.context import ContextCache, leave_compiled
from speculant.drafters.dflash.visibility import every_key_visible, keep_by_distance


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
    """Apply RoPE to ``x`` [..., heads, n, hd] with tables [n, hd] (or [..., 1, n, hd]; NeoX half rotation)."""
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
        """Rotated keys and values [..., kv_heads, n, hd] for rows ``x`` [..., n, H]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))).transpose(-3, -2)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim)).transpose(-3, -2)
        return rotate(k, cos, sin), v

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        """``x`` [n, H], or [rows, n, H] for several sequences (torch_rows.py). ``context``
        (:class:`ContextRows`, a ``ContextCache`` slot or padded rows) puts the block's keys and
        values after the context's."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))).transpose(-3, -2)
        q = rotate(q, cos, sin)
        k, v = context.join(*self.keys_values(x, cos, sin))
        groups = self.heads // self.kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=-3)
            v = v.repeat_interleave(groups, dim=-3)
        # one dtype for all three: under bf16 autocast rotated q/k come out float32 while v is
        # bf16, and autocast does not reach into torch.func.vmap (DFlash2's blockwise training)
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask,
                                             scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(-3, -2).flatten(-2))


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
    return keep_by_distance(torch.ones_like(rel, dtype=torch.bool), rel, causal, window)


class ContextRows(NamedTuple):
    """Context keys/values [kv_heads, n, hd] held apart from the block's (training)."""

    keys: torch.Tensor
    values: torch.Tensor

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)


class TorchDFlashNetwork:
    """:class:`~speculant.drafters.dflash.drafter.DFlashNetwork` over :class:`DFlashModel`,
    borrowing the target's embedding and head."""

    def __init__(self, model: DFlashModel, target, backend) -> None:
        self.model = model
        self.cfg = model.cfg
        self.target = target
        self.backend = backend
        self.windows = [layer.window for layer in model.layers]
        self.cache = ContextCache(self.windows, allocate)
        self._dtype = next(model.parameters()).dtype
        self.compiled = None  # a CompiledDraft (dflash/compiled.py) once compile_step succeeds
        self._eager_path = "eager"  # what runs when nothing is compiled, or why not
        self.layout_note: str | None = None  # the compiled step's weight layout (follow_target)

    def compile_step(self, block: int) -> None:
        """Run the draft step compiled (one graph per context bucket, see compiled.py), compiling
        every bucket a block of ``block`` uses now; stays eager, saying why, if compiling fails."""
        from speculant.drafters.dflash.compiled import CompiledDraft

        self.compiled = CompiledDraft(self.model, block)
        try:
            self.warm_up()
        except Exception as exc:  # noqa: BLE001 -- dynamo / inductor refused the step: eager is exact
            self.compiled = None
            self.fast_path = f"eager: compiling the draft failed ({type(exc).__name__}: {str(exc)[:200]})"

    @property
    def fast_path(self) -> str:
        """The compiled draft as it is now (its buckets, rows and compile time grow), or why eager."""
        if self.compiled is None:
            return self._eager_path
        return self.compiled.describe() + (f"; {self.layout_note}" if self.layout_note else "")

    @fast_path.setter
    def fast_path(self, value: str) -> None:
        self._eager_path = value

    def warm_up(self) -> None:
        """Compile the compiled step's graph of every context bucket (1, 2, 4 .. the padded block)
        for its current cache size, where not compiled yet."""
        from speculant.drafters.dflash.compiled import padded

        block = self.compiled.block
        device = next(self.model.parameters()).device
        features = torch.zeros(block, self.model.fc.in_features, device=device)
        ids = torch.full((block,), self.cfg.mask_token_id, dtype=torch.long, device=device)
        position = 0
        for j in range(padded(block).bit_length()):
            n = min(1 << j, block)
            position += n
            self.hidden(features[:n], position - n, ids, position)
        self.reset()

    def reset(self) -> None:
        self.cache = ContextCache(self.windows, allocate)

    def fork(self) -> "TorchDFlashNetwork":
        """The same modules and compiled graphs; an empty context cache (and compiled buffers)."""
        other = copy.copy(self)
        other.reset()
        if self.compiled is not None:
            other.compiled = self.compiled.fork()
        return other

    @torch.inference_mode()
    def hidden(self, features: torch.Tensor, context_start: int, block_ids: torch.Tensor, position: int) -> torch.Tensor:
        m, cfg, cache = self.model, self.cfg, self.cache
        q_len = block_ids.shape[0]
        device, dtype = features.device, self._dtype
        x = self.target.embed(block_ids, raw=True).to(dtype)  # table rows, as the reference feeds them
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        if self.compiled is not None:
            try:
                return self.compiled.hidden(features.to(dtype), context_start, x, position,
                                            lambda start, count: m.rotary.span(start, count, dtype, device))
            except Exception as exc:  # noqa: BLE001 -- e.g. recompiling for a grown cache failed: eager is exact
                self._fall_back_to_eager(exc, context_start)
                cache = self.cache
        self.take_in(features, context_start, reserve=q_len)
        cos, sin = m.rotary.span(position, q_len, dtype, device)
        for i, layer in enumerate(m.layers):
            mask = attention_mask(cache.starts[i], cache.length(i), position, q_len, layer.causal, layer.window, device)
            x = layer(x, cos, sin, cache.slot(i), mask)
        return m.norm(x[1:])

    def take_in(self, features: torch.Tensor, context_start: int, reserve: int) -> None:
        """Project new context rows (positions ``context_start ..``) and cache their keys/values
        in every layer, with room for ``reserve`` block rows after them."""
        take_in_rows([self], [(features, context_start)], reserve)

    def hidden_rows(self, nets, contexts, block_ids, positions, widths) -> torch.Tensor:
        """Several forks' blocks in one forward (torch_rows.py); eager, so never while compiled."""
        from speculant.drafters.dflash.torch_rows import hidden_rows

        return hidden_rows(nets, contexts, block_ids, positions, widths)

    def _fall_back_to_eager(self, exc: Exception, committed: int) -> None:
        """Go on eagerly, for this engine's life, from the context rows the compiled step holds:
        rows ``0 .. committed`` (by position) are the committed context; later ones were never
        committed or belong to the failed call, which runs again eagerly."""
        leave_compiled(self, committed)
        self.fast_path = (f"eager: the compiled draft step failed mid-request ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); eager from then on")

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        # a quantized draft may compute in another dtype than the target's head takes
        return self.target.lm_head(hidden.to(self.backend.dtype), raw=True).float()

    def tanh(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    def launch(self, tokens: torch.Tensor) -> None:
        """Eager: the proposal is already computed."""


def take_in_rows(nets, contexts, reserve: int) -> None:
    """:meth:`TorchDFlashNetwork.take_in` for several forks of one model at once: ``contexts[r]``
    (feature rows, position of the first) into ``nets[r]``'s cache, projected in one pass."""
    m, dtype = nets[0].model, nets[0]._dtype
    features = [f for f, _ in contexts]
    spans = [m.rotary.span(start, f.shape[0], dtype, f.device) for f, start in contexts]
    if len(contexts) == 1:
        (features,), ((cos, sin),) = features, spans
    else:
        features, cos, sin = torch.cat(features), torch.cat([c for c, _ in spans]), torch.cat([s for _, s in spans])
    ctx = m.project_context(features.to(dtype))
    ends = torch.tensor([f.shape[0] for f, _ in contexts]).cumsum(0).tolist()
    for i, layer in enumerate(m.layers):
        k, v = layer.self_attn.keys_values(ctx, cos, sin)
        for net, (_, start), end, rows in zip(nets, contexts, ends, (f.shape[0] for f, _ in contexts)):
            net.cache.append(i, k[:, end - rows:end], v[:, end - rows:end], start, reserve=reserve)


def allocate(like: torch.Tensor, rows: int) -> torch.Tensor:
    return like.new_empty((*like.shape[:-2], rows, like.shape[-1]))
