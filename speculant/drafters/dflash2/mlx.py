"""DFlash2 on MLX: the MLX DFlash network plus grouped dynamic convolutions around both
sublayers of every layer and the candidate selector; the shared
:class:`~speculant.drafters.dflash2.drafter.DFlash2Drafter` walks the round's score table on
the host after one transfer.

Same math and parameter names as :mod:`speculant.drafters.dflash2.torch`. Candidates are the
top-K of each row sorted by descending logit on both backends, so the walk sees the same
candidate order and the same host uniforms pick the same tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from speculant.core.types import DrafterInfo
from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.mlx import DecoderLayer, DFlashModel, MLXDFlashNetwork, follow_target
from speculant.drafters.dflash2.drafter import DFlash2Drafter


class GroupedDynamicConv(nn.Module):
    """Two-sided depthwise convolution over the block rows (axis 1 of ``[b, n, H]``: a block per
    sequence) with per-(row, group) dynamic taps; zeros before the anchor, no state across rounds."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        base = np.zeros((2, kernel_size, hidden_size), np.float32)
        base[:, 0] = 1.0  # identity: tap 0 passes the row through
        self.base_kernel = mx.array(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Side-0 convolution of ``x`` [b, n, H]; returns it and the side-1 taps [b, n, K, G]."""
        dynamic = self.kernel_projection(x).reshape(*x.shape[:2], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return self._convolve(y, dynamic, self.base_kernel[1])

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        b, n = x.shape[:2]
        rows = x.reshape(b, n, self.groups, self.group_size)
        kernel = base.astype(x.dtype).reshape(self.kernel_size, self.groups, self.group_size)
        out = kernel[0] * rows + dynamic[:, :, 0, :, None] * rows
        for tap in range(1, min(self.kernel_size, n)):
            zeros = mx.zeros((b, tap, self.groups, self.group_size), dtype=x.dtype)
            earlier = mx.concatenate([zeros, rows[:, : n - tap]], axis=1)
            out = (out + kernel[tap] * earlier) + dynamic[:, :, tap, :, None] * earlier
        return out.reshape(x.shape)


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__(cfg, index)
        H, K, group = cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicConv(H, K, group)
        self.mlp_conv = GroupedDynamicConv(H, K, group)

    def __call__(self, x, ctx, ctx_start, position, cache, mask) -> mx.array:
        a, taps = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(a, ctx, ctx_start, position, cache, mask), taps)
        m, taps = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(m), taps)


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.rank = rank = cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        self.predecessor_codebook = mx.zeros((cfg.vocab_size, rank))
        self.successor_codebook = mx.zeros((cfg.vocab_size, rank))

    def codebooks_as_embeddings(self) -> None:
        """Hold both tables as ``nn.Embedding`` layers so ``mlx.nn.quantize`` can quantize them
        (a quantized embedding dequantizes only the gathered rows); same values, same lookups."""
        for name in ("predecessor_codebook", "successor_codebook"):
            table = getattr(self, name)
            embedding = nn.Embedding(*table.shape)
            embedding.weight = table
            setattr(self, name, embedding)

    def rows(self, name: str, ids: mx.array | int) -> mx.array:
        """Rows ``ids`` of codebook ``name`` in float32, whether it is a table or an embedding layer."""
        table = getattr(self, name)
        if not isinstance(table, nn.Module):
            return table[ids].astype(mx.float32)
        ids = mx.array(ids)  # a quantized embedding gathers 1-D and non-empty only: flatten, then restore
        if ids.size == 0:
            return mx.zeros((*ids.shape, self.rank), mx.float32)
        return table(ids.reshape(-1)).reshape(*ids.shape, self.rank).astype(mx.float32)

    def score_table(self, hidden: mx.array, logits: mx.array, anchor_id: int) -> tuple[mx.array, mx.array]:
        """Flat float32 scores (row 0 [K], then [k-1, K, K]) and candidate ids [k, K] (int32)."""
        K = self.top_k
        logits = logits.astype(mx.float32)
        top = mx.argpartition(-logits, kth=K - 1, axis=-1)[:, :K]
        order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1), axis=-1)
        candidates = mx.take_along_axis(top, order, axis=-1)  # descending logit, as torch.topk
        unary = mx.take_along_axis(logits, candidates, axis=-1)
        gate = self.hidden_projection(hidden).astype(mx.float32)
        successors = self.rows("successor_codebook", candidates)  # [k, K, r]
        anchor = self.rows("predecessor_codebook", anchor_id)
        first = unary[0] + successors[0] @ (anchor * gate[0])
        predecessors = self.rows("predecessor_codebook", candidates[:-1]) * gate[1:, None, :]
        pairs = unary[1:, None, :] + predecessors @ successors[1:].transpose(0, 2, 1)
        return mx.concatenate([first, pairs.reshape(-1)]), candidates.astype(mx.int32)


class DFlash2Model(DFlashModel):
    layer_class = DFlash2DecoderLayer

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)


class MLXDFlash2Network(MLXDFlashNetwork):
    """:class:`~speculant.drafters.dflash2.drafter.DFlash2Network` over :class:`DFlash2Model`."""

    def score_table(self, hidden: mx.array, logits: mx.array, anchor_id: int) -> tuple[np.ndarray, mx.array]:
        scores, candidates = self.model.candidate_selector.score_table(hidden, logits, anchor_id)
        flat = mx.concatenate([scores, candidates.reshape(-1).astype(mx.float32)])
        mx.eval(flat, candidates, *self.cache_arrays())  # one host read per round, caches included
        return np.array(flat), candidates


def load_mlx_dflash2(config, info: DrafterInfo, backend, target) -> DFlash2Drafter:
    """Build, load (either codebook spelling), optionally quantize, and bind to ``target``."""
    from speculant.core.checkpoint import tensor_inventory
    from speculant.core.errors import CheckpointError
    from speculant.drafters import quantization
    from speculant.drafters.dflash.mlx import load_weights
    from speculant.drafters.dflash2.checkpoint import CODEBOOKS, codebook_spelling

    _, problems = codebook_spelling(tensor_inventory(config.path))
    if problems:
        raise CheckpointError("; ".join(str(p) for p in problems))
    model = DFlash2Model(info.extra["config"])
    load_weights(model, config.path, rename={name + ".weight": name for name in CODEBOOKS})
    dtype = backend.dtype
    q = quantization.resolve(config.quantization)
    if q is not None:
        dtype = getattr(mx, quantization.activation_dtype(q, str(backend.dtype).rsplit(".", 1)[-1]))
    model.set_dtype(dtype)
    if q is not None:
        if q.quantize_all:
            model.candidate_selector.codebooks_as_embeddings()
        quantization.quantize_mlx(model, q, quantization.exclude_for(info, q))
    model.eval()
    mx.eval(model.parameters())
    return DFlash2Drafter(follow_target(MLXDFlash2Network(model, target, dtype), config, info, target), info, backend)
