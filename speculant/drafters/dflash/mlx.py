"""DFlash draft model on MLX: config -> modules -> forward, then the network the shared
:class:`~speculant.drafters.dflash.drafter.DFlashDrafter` drives.

The same math as :mod:`speculant.drafters.dflash.torch`: the target's hidden states of
``target_layer_ids`` are projected once (``fc`` + ``hidden_norm``) into a context whose
keys/values are injected into every draft layer, and the block ``[anchor, mask x k]`` is
denoised in one pass. Only context keys/values are cached; sliding-window layers keep the
last ``sliding_window - 1`` context rows. Nothing here leaves the device: a proposal is lazy
token ids that the target's verify forward consumes directly.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from speculant.core.types import DrafterInfo
from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.context import BlockSlot, ContextCache
from speculant.drafters.dflash.drafter import DFlashDrafter
from speculant.drafters.dflash.visibility import every_key_visible, keep_by_distance


def make_rope(cfg: DFlashConfig) -> nn.Module:
    """mlx-lm's RoPE for the draft's rope settings (any rope_type mlx-lm knows)."""
    from mlx_lm.models.rope_utils import initialize_rope

    rope = dict(cfg.rope)
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    return initialize_rope(cfg.head_dim, base=float(rope["rope_theta"]), traditional=False,
                           scaling_config=scaling, max_position_embeddings=cfg.max_position_embeddings)


class Attention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.scale = hd ** -0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(H, self.heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, H, bias=bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.rope = make_rope(cfg)
        self.rope_takes_offsets = isinstance(self.rope, rope_takes_offsets())

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        return x.reshape(*x.shape[:2], n_heads, self.head_dim).transpose(0, 2, 1, 3)

    def keys_values(self, rows: mx.array) -> tuple[mx.array, mx.array]:
        """Keys (normed, not yet rotated) and values [b, kv_heads, n, hd] of ``rows`` [b, n, H]."""
        return self.k_norm(self._heads(self.k_proj(rows), self.kv_heads)), self._heads(self.v_proj(rows), self.kv_heads)

    def rotate(self, x: mx.array, position) -> mx.array:
        """RoPE of ``x`` [b, heads, n, hd] from ``position`` (an int, or a scalar array in the
        compiled step) on, or from each row's own first position (:class:`RowPositions`)."""
        if not isinstance(position, RowPositions):
            return self.rope(x, offset=position)
        if self.rope_takes_offsets:
            return self.rope(x, offset=position.offsets)
        # a row by row RoPE may depend on the rows given (dynamic NTK: on the last position), so
        # each row's own block is rotated as its own forward would; its filler rows stay as they are
        rows = []
        for r, (first, length) in enumerate(zip(position.first, position.lengths)):
            block, filler = x[r:r + 1, :, :length], x[r:r + 1, :, length:]
            rows.append(mx.concatenate([self.rope(block, offset=first), filler], axis=2))
        return mx.concatenate(rows)

    def __call__(self, x: mx.array, ctx: mx.array, ctx_start: int, position, context: BlockSlot, mask) -> mx.array:
        """``x`` [1, q, H] block rows at ``position``..; ``ctx`` [1, n, H] new context rows at
        ``ctx_start``.. (n may be 0), committed to ``context``, which holds the earlier ones.
        Several sequences' blocks (mlx_rows.py): ``x`` [rows, q, H] at :class:`RowPositions`, no
        new context rows, ``context`` their padded context."""
        batch, q_len, n_ctx = x.shape[0], x.shape[1], ctx.shape[1]
        q = self.rotate(self.q_norm(self._heads(self.q_proj(x), self.heads)), position)
        k, v = self.keys_values(mx.concatenate([ctx, x], axis=1) if n_ctx else x)
        if n_ctx:
            context.append(self.rotate(k[:, :, :n_ctx], ctx_start), v[:, :, :n_ctx], ctx_start, reserve=q_len)
        k, v = context.join(self.rotate(k[:, :, n_ctx:], position), v[:, :, n_ctx:])
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, q_len, -1))


class RowPositions(NamedTuple):
    """Where each sequence's block lies when several are drafted at once (mlx_rows.py): its first
    position (as ints, and as the array of offsets ``mx.fast.rope`` takes) and its own length
    (rows past it are filler)."""

    first: tuple[int, ...]
    lengths: tuple[int, ...]
    offsets: mx.array


def rope_takes_offsets() -> tuple[type, ...]:
    """mlx-lm's RoPE classes that hand ``offset`` straight to ``mx.fast.rope``, so an array of
    per-row offsets works; any other (the dynamic NTK one derives its base from a scalar offset)
    rotates row by row."""
    from mlx_lm.models import rope_utils

    names = ("SuScaledRoPE", "Llama3RoPE", "YarnRoPE", "ProportionalRoPE")
    return (nn.RoPE, *(getattr(rope_utils, n) for n in names if hasattr(rope_utils, n)))


class MLP(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.causal = cfg.layer_is_causal(index)
        self.window = cfg.layer_window(index)

    def __call__(self, x, ctx, ctx_start, position, cache, mask) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), ctx, ctx_start, position, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    """The draft network; parameter names match the published checkpoints."""

    layer_class: type[nn.Module] = DecoderLayer  # a DFlash2 port swaps in layers with convolutions

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)
        self.layers = [self.layer_class(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=cfg.rms_norm_eps)

    def project_context(self, features: mx.array) -> mx.array:
        return self.hidden_norm(self.fc(features))


def block_mask(n_ctx: int, ctx_end: int, position: int, q_len: int, causal: bool, window: int | None):
    """Boolean keep-mask [q, n_ctx + q] over [context rows ending at ``ctx_end``; block], or None
    when every key is visible."""
    if every_key_visible(ctx_end - n_ctx, position, q_len, causal, window):
        return None
    queries = mx.arange(position, position + q_len)
    keys = mx.concatenate([mx.arange(ctx_end - n_ctx, ctx_end), queries])
    rel = queries[:, None] - keys[None, :]  # query - key
    return keep_by_distance(mx.ones(rel.shape, dtype=mx.bool_), rel, causal, window)


class MLXDFlashNetwork:
    """:class:`~speculant.drafters.dflash.drafter.DFlashNetwork` over :class:`DFlashModel`,
    borrowing the target's embedding and head."""

    def __init__(self, model: DFlashModel, target, dtype) -> None:
        self.model = model
        self.cfg = model.cfg
        self.target = target
        self.dtype = dtype  # the draft's compute dtype
        self.target_dtype = target.embed(mx.array([0], dtype=mx.int32)).dtype  # what the target's head takes
        self.fast_path = target.prepare_draft(model) or "eager"  # transposed weights where the target's are
        self.windows = [layer.window for layer in model.layers]
        self.cache = ContextCache(self.windows, allocate)
        self.compiled = None  # a CompiledDraft (mlx_compiled.py) once compile_step is called

    def compile_step(self, block: int) -> None:
        """Run the draft step compiled (mlx_compiled.py), for blocks of ``block`` tokens."""
        from speculant.drafters.dflash.mlx_compiled import CompiledDraft

        self.compiled = CompiledDraft(self.model, block)
        self.fast_path = f"compiled draft step (mx.compile per context bucket; block {block})" + \
            ("" if self.fast_path == "eager" else f"; {self.fast_path.removeprefix('eager; ')}")

    def reset(self) -> None:
        self.cache = ContextCache(self.windows, allocate)
        if self.compiled is not None:
            self.compiled.reset()

    def fork(self) -> "MLXDFlashNetwork":
        """The same modules and compiled function; an empty context cache (and compiled buffers)."""
        other = copy.copy(self)
        if self.compiled is not None:
            other.compiled = self.compiled.fork()
        other.reset()
        return other

    def cache_arrays(self) -> list[mx.array]:
        """Every buffer the last step wrote (MLX schedules their pending writes with a draft)."""
        return self.cache.arrays() if self.compiled is None else self.compiled.arrays()

    def hidden(self, features: mx.array, context_start: int, block_ids: mx.array, position: int) -> mx.array:
        m, cfg, cache = self.model, self.cfg, self.cache
        x = self.target.embed(block_ids, raw=True).astype(self.dtype)[None]  # table rows, as the reference feeds them
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        if self.compiled is not None:
            return self.compiled.hidden(features.astype(self.dtype), context_start, x[0], position)
        ctx = m.project_context(features.astype(self.dtype))[None]
        n_ctx, q_len = ctx.shape[1], block_ids.shape[0]
        ctx_end = context_start + n_ctx
        masks: dict = {}
        for i, layer in enumerate(m.layers):
            kind = (layer.causal, layer.window)  # every layer holds the same context rows
            if kind not in masks:
                held = cache.length(i) + n_ctx
                if layer.window is not None:
                    held = min(held, layer.window - 1)
                masks[kind] = block_mask(held, ctx_end, position, q_len, layer.causal, layer.window)
            x = layer(x, ctx, context_start, position, cache.slot(i), masks[kind])
        return m.norm(x[0, 1:])

    def hidden_rows(self, nets, contexts, block_ids, positions, widths) -> mx.array:
        """Several forks' blocks in one forward (mlx_rows.py); eager, so never while compiled."""
        from speculant.drafters.dflash.mlx_rows import hidden_rows

        return hidden_rows(nets, contexts, block_ids, positions, widths)

    def head(self, hidden: mx.array) -> mx.array:
        return self.target.lm_head(hidden.astype(self.target_dtype), raw=True).astype(mx.float32)

    def tanh(self, x: mx.array) -> mx.array:
        return mx.tanh(x)

    def launch(self, tokens: mx.array) -> None:
        """Nothing leaves the device: the target's verify forward consumes the lazy ids."""
        mx.async_eval(tokens, *self.cache_arrays())


def allocate(like: mx.array, rows: int) -> mx.array:
    return mx.zeros((*like.shape[:-2], rows, like.shape[-1]), dtype=like.dtype)


def load_weights(model: DFlashModel, folder, rename: dict[str, str] | None = None) -> None:
    """Strict load of the published safetensors: every tensor present, a float, right shape, nothing extra.

    ``rename`` maps on-disk names to parameter names (applied when the old name is present).
    """
    from mlx.utils import tree_flatten

    from speculant.core.checkpoint import require_float_tensors, safetensors_files
    from speculant.core.errors import CheckpointError

    require_float_tensors(folder)
    weights: dict[str, mx.array] = {}
    for file in safetensors_files(folder):
        weights.update(mx.load(str(file)))
    for old, new in (rename or {}).items():
        if old in weights:
            weights[new] = weights.pop(old)
    own = dict(tree_flatten(model.parameters()))
    problems = [f"missing tensor {k}" for k in own if k not in weights]
    problems += [f"unexpected tensor {k}" for k in weights if k not in own]
    problems += [f"tensor {k} has shape {list(weights[k].shape)}, expected {list(own[k].shape)}"
                 for k in own if k in weights and weights[k].shape != own[k].shape]
    if problems:
        raise CheckpointError(f"{folder}: " + "; ".join(problems))
    model.load_weights(list(weights.items()), strict=True)


def load_mlx_drafter(config, info: DrafterInfo, backend, target) -> DFlashDrafter:
    """Build the draft from ``info.extra['config']``, load its weights, optionally quantize it."""
    from speculant.drafters import quantization
    from speculant.drafters.dflash import muse_glimmer

    cfg = info.extra["config"]
    model = DFlashModel(cfg)
    load_weights(model, config.path, rename=muse_glimmer.TENSOR_NAMES if cfg.is_muse_glimmer else None)
    dtype = backend.dtype
    q = quantization.resolve(config.quantization)
    if q is not None:
        dtype = getattr(mx, quantization.activation_dtype(q, _dtype_name(backend.dtype)))
    model.set_dtype(dtype)
    if q is not None:
        quantization.quantize_mlx(model, q, quantization.exclude_for(info, q))
    model.eval()
    mx.eval(model.parameters())
    return DFlashDrafter(follow_target(MLXDFlashNetwork(model, target, dtype), config, info, target), info, backend)


def follow_target(network: MLXDFlashNetwork, config, info: DrafterInfo, target) -> MLXDFlashNetwork:
    """Run the draft step compiled where the target's whole forward is (static.py)."""
    if getattr(target, "compiles_whole", False):
        network.compile_step(config.block_size or info.default_block_size or info.trained_block_size or 2)
    return network


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]
