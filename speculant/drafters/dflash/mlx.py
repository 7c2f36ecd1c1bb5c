"""DFlash draft model on MLX: config -> modules -> forward, then the Drafter around it.

The same math as :mod:`speculant.drafters.dflash.torch`: the target's hidden states of
``target_layer_ids`` are projected once (``fc`` + ``hidden_norm``) into a context whose
keys/values are injected into every draft layer, and the block ``[anchor, mask x k]`` is
denoised in one pass. Only context keys/values are cached; sliding-window layers keep the
last ``sliding_window - 1`` context rows. Nothing here leaves the device: ``propose`` returns
lazy token ids that the target's verify forward consumes directly.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn

from speculant.core.interfaces import Drafter
from speculant.core.types import Draft, DrafterInfo, DraftRequest, ForwardOutput
from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.visibility import every_key_visible


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

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        return x.reshape(1, x.shape[1], n_heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, ctx: mx.array, ctx_start: int, position: int, cache, mask) -> mx.array:
        """``x`` [1, q, H] block rows at ``position``..; ``ctx`` [1, n, H] new context rows at
        ``ctx_start``.. (n may be 0); ``cache`` holds the earlier context keys/values."""
        q_len, n_ctx = x.shape[1], ctx.shape[1]
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), offset=position)
        rows = mx.concatenate([ctx, x], axis=1) if n_ctx else x
        k = self.k_norm(self._heads(self.k_proj(rows), self.kv_heads))
        v = self._heads(self.v_proj(rows), self.kv_heads)
        block_k = self.rope(k[:, :, n_ctx:], offset=position)
        if n_ctx:
            ctx_k, ctx_v = cache.append(self.rope(k[:, :, :n_ctx], offset=ctx_start), v[:, :, :n_ctx])
        else:
            ctx_k, ctx_v = cache.fetch()
        if ctx_k is not None:
            block_k = mx.concatenate([ctx_k, block_k], axis=2)
            v = mx.concatenate([ctx_v, v[:, :, n_ctx:]], axis=2)
        else:
            v = v[:, :, n_ctx:]
        out = mx.fast.scaled_dot_product_attention(q, block_k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(1, q_len, -1))


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


class ContextKV:
    """Keys/values [1, kv_heads, n, hd] of the committed context rows of one layer.

    Full-attention layers use mlx-lm's growing ``KVCache``; a sliding layer keeps only its
    last ``window - 1`` rows (a block query never sees more).
    """

    def __init__(self, window: int | None) -> None:
        from mlx_lm.models.cache import KVCache

        self.window = window
        self._kv = KVCache() if window is None else None
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = 0  # rows held

    def append(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        if self._kv is not None:
            self.keys, self.values = self._kv.update_and_fetch(k, v)
        else:
            if self.keys is not None:
                k = mx.concatenate([self.keys, k], axis=2)
                v = mx.concatenate([self.values, v], axis=2)
            keep = self.window - 1
            if k.shape[2] > keep:
                k, v = k[:, :, -keep:], v[:, :, -keep:]
            self.keys, self.values = k, v
        self.length = int(self.keys.shape[2])
        return self.keys, self.values

    def fetch(self) -> tuple[mx.array | None, mx.array | None]:
        return self.keys, self.values

    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]


def block_mask(n_ctx: int, ctx_end: int, position: int, q_len: int, causal: bool, window: int | None):
    """Boolean keep-mask [q, n_ctx + q] over [context rows ending at ``ctx_end``; block], or None
    when every key is visible."""
    if every_key_visible(ctx_end - n_ctx, position, q_len, causal, window):
        return None
    queries = mx.arange(position, position + q_len)
    keys = mx.concatenate([mx.arange(ctx_end - n_ctx, ctx_end), queries])
    rel = queries[:, None] - keys[None, :]  # query - key
    keep = mx.ones(rel.shape, dtype=mx.bool_)
    if causal:
        keep = keep & (rel >= 0)
    if window is not None:
        keep = keep & (rel < window)
        if not causal:
            keep = keep & (rel > -window)
    return keep


class MLXDFlashDrafter(Drafter):
    """Drafter protocol over :class:`DFlashModel`, borrowing the target's embedding and head."""

    def __init__(self, model: DFlashModel, info: DrafterInfo, target, backend, dtype) -> None:
        self.model = model
        self.cfg = model.cfg
        self.info = info
        self.target = target
        self.backend = backend
        self.dtype = dtype  # the draft's compute dtype
        self.target_dtype = target.embed(mx.array([0], dtype=mx.int32)).dtype  # what the target's head takes
        windows = [layer.window for layer in model.layers]
        # when every layer slides, older context rows can never be seen again
        self.max_context = None if any(w is None for w in windows) else max(windows) - 1
        self.caches: list[ContextKV] = []
        self.pending: list[mx.array] = []
        self.context_length = 0  # absolute position one past the last context row taken in

    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        self.caches = [ContextKV(layer.window) for layer in self.model.layers]
        self.pending = [output.features]
        self.context_length = 0

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        self.pending.append(output.features[:num_rows])

    def _take_context(self) -> tuple[mx.array, int]:
        """Projected new context rows [1, n, H] and the absolute position of the first."""
        features = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=0)
        self.pending = []
        start = self.context_length
        self.context_length += int(features.shape[0])
        if self.max_context is not None and features.shape[0] > self.max_context:
            start = self.context_length - self.max_context
            features = features[-self.max_context:]
        return self.model.project_context(features.astype(self.dtype))[None], start

    def hidden(self, request: DraftRequest) -> mx.array:
        """Final-normed draft hidden states of block rows 1..k ([k, H])."""
        m, cfg = self.model, self.cfg
        k = request.num_tokens
        ctx, ctx_start = self._take_context()
        ids = mx.array([request.anchor_id] + [cfg.mask_token_id] * k, dtype=mx.int32)
        x = self.target.embed(ids).astype(self.dtype)[None]
        if cfg.input_embedding_scale != 1.0:
            x = x * cfg.input_embedding_scale
        ctx_end, position = self.context_length, request.position
        masks: dict = {}
        for layer, cache in zip(m.layers, self.caches):
            kind = (layer.causal, layer.window)  # every layer holds the same context rows
            if kind not in masks:
                held = cache.length + ctx.shape[1]
                if layer.window is not None:
                    held = min(held, layer.window - 1)
                masks[kind] = block_mask(held, ctx_end, position, k + 1, layer.causal, layer.window)
            x = layer(x, ctx, ctx_start, position, cache, masks[kind])
        return m.norm(x[0, 1:])

    def logits(self, hidden: mx.array) -> mx.array:
        # the bare head (the MLX target's, before its logit transform), as on PyTorch
        logits = self.target._head(hidden.astype(self.target_dtype)).astype(mx.float32)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = cap * mx.tanh(logits / cap)
        return logits

    def propose(self, request: DraftRequest) -> Draft:
        tokens = mx.argmax(self.logits(self.hidden(request)), axis=-1).astype(mx.int32)
        mx.async_eval(tokens, *[a for c in self.caches for a in c.state()])
        return Draft(token_ids=tokens, num_tokens=request.num_tokens)


def load_weights(model: DFlashModel, folder, rename: dict[str, str] | None = None) -> None:
    """Strict load of the published safetensors: every tensor present, right shape, nothing extra.

    ``rename`` maps on-disk names to parameter names (applied when the old name is present).
    """
    from mlx.utils import tree_flatten

    from speculant.core.checkpoint import safetensors_files
    from speculant.core.errors import CheckpointError

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


def load_mlx_drafter(config, info: DrafterInfo, backend, target) -> MLXDFlashDrafter:
    """Build the draft from ``info.extra['config']``, load its weights, optionally quantize it."""
    from speculant.drafters import quantization

    cfg = info.extra["config"]
    model = DFlashModel(cfg)
    load_weights(model, config.path)
    dtype = backend.dtype
    q = quantization.resolve(config.quantization)
    if q is not None:
        dtype = getattr(mx, quantization.activation_dtype(q, _dtype_name(backend.dtype)))
    model.set_dtype(dtype)
    if q is not None:
        quantization.quantize_mlx(model, q, quantization.exclude_for(info, q))
    model.eval()
    mx.eval(model.parameters())
    return MLXDFlashDrafter(model, info, target, backend, dtype)


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]
