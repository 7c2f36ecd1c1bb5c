"""DFlash2 on PyTorch: the DFlash v1 network plus grouped dynamic convolutions around both
sublayers of every layer and the candidate selector, whose score table the shared
:class:`~speculant.drafters.dflash2.drafter.DFlash2Drafter` walks on the host.

Tensor names match the published checkpoints (the codebooks are plain parameters named
``candidate_selector.{predecessor,successor}_codebook``, as on disk).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.torch import DecoderLayer, DFlashModel, TorchDFlashNetwork


class GroupedDynamicConv(nn.Module):
    """Two-sided depthwise convolution over the block with per-(row, group) dynamic taps.

    ``base_kernel[side, tap, channel]``; ``kernel_projection`` maps the normalised sublayer
    input to ``[side, tap, group]`` corrections shared by the ``group_size`` channels of a
    group. Side 0 convolves the sublayer input (:meth:`prepare`), side 1 its output
    (:meth:`finish`), both with corrections predicted from the input. Tap j reads the row j
    places earlier in the block; rows before the anchor are zeros, so nothing crosses the
    block boundary and no state carries across rounds.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0  # identity: tap 0 passes the row through
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Side-0 convolution of ``x`` [..., n, H] (a block, or one per row); returns it and the
        side-1 taps [..., n, K, G]."""
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """Side-1 convolution of the sublayer output with the taps from :meth:`prepare`."""
        return self._convolve(y, dynamic, self.base_kernel[1])

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        # Same accumulation order as the reference (base term, then the correction), so float32
        # results match it bit for bit; rows before the anchor contribute exact zeros, skipped.
        n = x.shape[-2]
        rows = x.unflatten(-1, (self.groups, self.group_size))  # [..., n, G, g]
        kernel = base.to(x.dtype).view(self.kernel_size, self.groups, self.group_size)
        out = torch.addcmul(kernel[0] * rows, dynamic[..., 0, :, None], rows)
        for tap in range(1, min(self.kernel_size, n)):
            earlier = rows[..., : n - tap, :, :]
            out[..., tap:, :, :] = torch.addcmul(out[..., tap:, :, :] + kernel[tap] * earlier,
                                                 dynamic[..., tap:, tap, :, None], earlier)
        return out.flatten(-2)


class DFlash2DecoderLayer(DecoderLayer):
    """A DFlash v1 layer with a convolution around attention and one around the MLP."""

    def __init__(self, cfg: DFlashConfig, index: int) -> None:
        super().__init__(cfg, index)
        H, K, group = cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size
        self.attention_conv = GroupedDynamicConv(H, K, group)
        self.mlp_conv = GroupedDynamicConv(H, K, group)

    def forward(self, x, cos, sin, context, mask) -> torch.Tensor:
        a, taps = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(a, cos, sin, context, mask), taps)
        m, taps = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(m), taps)


class CandidateSelector(nn.Module):
    """Top-K candidates per row plus a low-rank, hidden-gated bigram score between rows."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        rank = cfg.selector_rank
        self.top_k = cfg.selector_top_k
        self.hidden_projection = nn.Linear(cfg.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, rank))

    def codebooks_as_embeddings(self) -> None:
        """Hold both tables as ``nn.Embedding`` layers so torchao can quantize them (its quantized
        embedding dequantizes only the gathered rows); same values, same lookups."""
        for name in ("predecessor_codebook", "successor_codebook"):
            table = getattr(self, name)
            delattr(self, name)
            setattr(self, name, nn.Embedding.from_pretrained(table.detach(), freeze=True))

    def rows(self, name: str, ids: torch.Tensor | int) -> torch.Tensor:
        """Rows ``ids`` of codebook ``name`` in float32, whether it is a table or an embedding layer."""
        table = getattr(self, name)
        if isinstance(table, nn.Embedding):
            return table(torch.as_tensor(ids, device=table.weight.device)).float()
        return table[ids].float()

    def score_table(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores (flat float32: row 0 [K], then [k-1, K, K]) and candidate ids [k, K].

        ``hidden`` [k, H] are the final-normed draft rows, ``logits`` [k, V] their processed
        float32 logits. Everything after the hidden projection is float32.
        """
        unary, candidates = torch.topk(logits.float(), self.top_k, dim=-1)
        gate = self.hidden_projection(hidden).float()  # z_t [k, r]
        successors = self.rows("successor_codebook", candidates)  # B[C_t] [k, K, r]
        anchor = self.rows("predecessor_codebook", anchor_id)  # A[anchor] [r]
        first = unary[0] + successors[0] @ (anchor * gate[0])
        predecessors = self.rows("predecessor_codebook", candidates[:-1]) * gate[1:, None, :]  # [k-1, K, r]
        pairs = unary[1:, None, :] + predecessors @ successors[1:].transpose(1, 2)
        return torch.cat([first, pairs.reshape(-1)]), candidates


class DFlash2Model(DFlashModel):
    layer_class = DFlash2DecoderLayer

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__(cfg)
        self.candidate_selector = CandidateSelector(cfg)


class TorchDFlash2Network(TorchDFlashNetwork):
    """:class:`~speculant.drafters.dflash2.drafter.DFlash2Network` over :class:`DFlash2Model`."""

    @torch.inference_mode()
    def score_table(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_id: int) -> tuple[np.ndarray, torch.Tensor]:
        scores, candidates = self.model.candidate_selector.score_table(hidden, logits, anchor_id)
        return torch.cat([scores, candidates.reshape(-1).float()]).cpu().numpy(), candidates
