"""Train a DFlash2 drafter against a local Hugging Face target.

Backbone objective: DFlash's (speculant.training.dflash: target-generated sequences, random
anchors, block [anchor, mask x (B-1)], decay-weighted cross-entropy), with the DFlash2 layers
(dynamic convolutions around both sublayers). The convolutions are block-local, so each block
runs through them on its own (``torch.func.vmap`` over the blocks of a sequence, the drafter's
own layer modules).

Identity initialisation (dflash2.md §3.6): base kernel tap 0 = 1 and the other taps 0, zero
kernel projection, zero successor codebook (random predecessor codebook and gate projection,
so gradients reach the successor codebook): an untrained DFlash2 proposes what DFlash does.

Selector objective: for block row t with candidates C_t = top-K of its logits and unary scores
U_t, the score of candidate b is U_t(b) + <A[x_{t-1}] * W_h h_t, B[b]> with the *true*
predecessor x_{t-1} (the anchor for row 0); cross-entropy towards the true token's index in
C_t. Rows whose true token is not among the candidates are excluded and reported as
``candidate_recall``. The selector loss trains only the selector (unary scores and hidden
states are detached), weighted by ``selector_weight``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from speculant.core.types import Capture
from speculant.core.validator import text_config
from speculant.drafters.dflash.config import DFlashConfig, parse_config, published_config
from speculant.training.dflash import (Blocks, anchor_batch, anchor_rows, copy_draft, draft_forward, mask_token_id,
                                       on_device, sequence_summary, shape_layer_ids, target_dtype, weighted_block_ce)
from speculant.training.features import capture_batch, load_frozen_target
from speculant.training.loop import Objective, TrainSettings, call_objective, is_main_process, train

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


@dataclass
class DFlash2Shape:
    num_layers: int = 2
    block_size: int = 8
    num_features: int = 3
    anchors_per_sequence: int = 32
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 32
    selector_top_k: int = 8
    sliding_window: int = 2048
    selector_weight: float = 1.0
    target_layer_ids: tuple[int, ...] | None = None  # None: the published spacing for num_features
    mask_token_id: int | None = None  # None: the tokenizer's <|mask|> token


def dflash2_config(target: dict, mask: int, shape: DFlash2Shape) -> dict:
    """The published DFlash2 config.json layout (every DFlash key inside ``dflash_config``)."""
    layer_ids = shape_layer_ids(shape, target["num_hidden_layers"])
    keys = {"conv_kernel_size": shape.conv_kernel_size, "conv_group_size": shape.conv_group_size,
            "selector_rank": shape.selector_rank, "selector_top_k": shape.selector_top_k}
    config = published_config(target, mask, layer_ids, shape.num_layers, shape.block_size, shape.sliding_window,
                              architecture="DFlash2DraftModel", extra_dflash=keys, is_causal=False)
    config.pop("block_size", None)
    config["max_window_layers"] = shape.num_layers
    return config


def new_dflash2_config(target_dir: Path, out_dir: Path, shape: DFlash2Shape) -> DFlashConfig:
    tcfg = text_config(json.loads((target_dir / "config.json").read_text()))  # composite: the text part
    mask = mask_token_id(target_dir, "DFlash2", shape.mask_token_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(dflash2_config(tcfg, mask, shape), indent=2))
    cfg, problems = parse_config(out_dir)
    if problems:
        raise ValueError("; ".join(map(str, problems)))
    return cfg


def init_dflash2(cfg: DFlashConfig, seed: int):
    from speculant.drafters.dflash2.torch import DFlash2Model

    torch.manual_seed(seed)
    model = DFlash2Model(cfg)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0.0, 0.02)
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        selector = model.candidate_selector
        torch.nn.init.normal_(selector.hidden_projection.weight, 0.0, cfg.hidden_size ** -0.5)
        torch.nn.init.normal_(selector.predecessor_codebook, 0.0, 1.0)
        selector.successor_codebook.zero_()
    return model


def blockwise(block_size: int):
    """``run_layer`` for :func:`draft_forward`: each block through the layer on its own (the
    convolutions never cross a block boundary), attending to its context rows and its block."""

    def run_layer(layer, x, cos, sin, context, mask):
        B = block_size
        n = x.shape[0] // B
        S = mask.shape[1] - n * B
        keep = torch.cat([mask[:, :S].reshape(n, B, S), torch.ones(n, B, B, dtype=torch.bool, device=mask.device)], dim=-1)
        run = torch.func.vmap(layer, in_dims=(0, 0, 0, None, 0))
        out = run(x.view(n, B, -1), cos.view(n, B, -1), sin.view(n, B, -1), context, keep)
        return out.reshape(n * B, -1)

    return run_layer


def selector_loss(selector, hidden, logits, predecessors, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """Selector cross-entropy over the top-K candidates of each row, scored with the true
    predecessor; rows whose true token is not a candidate are left out. Returns (loss, recall).

    ``hidden`` [m, H] final-normed draft rows, ``logits`` [m, V] their float32 logits,
    ``predecessors`` / ``labels`` [m] the true previous and current tokens.
    """
    unary, candidates = torch.topk(logits.detach().float(), selector.top_k, dim=-1)
    gate = selector.hidden_projection(hidden.detach()).float()
    weighted = selector.predecessor_codebook[predecessors].float() * gate  # [m, r]
    scores = unary + torch.einsum("mr,mkr->mk", weighted, selector.successor_codebook[candidates].float())
    hit = candidates == labels[:, None]
    found = hit.any(-1).float()
    # masked rather than indexed, so no device sync: rows without the true token weigh nothing
    ce = F.cross_entropy(scores, hit.float().argmax(-1), reduction="none")
    return (ce * found).sum() / found.sum().clamp(min=1.0), found.mean()


def dflash2_loss(model, target, features, tokens, anchors, cfg: DFlashConfig, selector_weight: float):
    """Backbone and selector losses of every block (one sequence or a batch, as :func:`draft_forward`)."""
    B = cfg.block_size
    blocks = Blocks.of(tokens, anchors)
    hidden = draft_forward(model, target, features, tokens, blocks, cfg, run_layer=blockwise(B))[:, 1:]
    logits = target._head(hidden).float() * cfg.output_multiplier
    labels = blocks.labels(B)
    loss, metrics = weighted_block_ce(logits, labels, B)
    predecessors = blocks.previous(B)
    sel, recall = selector_loss(model.candidate_selector, hidden.reshape(-1, hidden.shape[-1]),
                                logits.reshape(-1, logits.shape[-1]), predecessors.reshape(-1), labels.reshape(-1))
    return loss + selector_weight * sel, {**metrics, "selector": sel.detach(), "candidate_recall": recall.detach()}


def save_dflash2(model, out_dir: Path) -> None:
    """model.safetensors in the published layout (codebooks without a ``.weight`` suffix)."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu().float() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def warm_start(model, dflash_dir: str | Path, target_layer_ids: list[int]) -> None:
    """Copy a trained DFlash draft (same target, layers, target layer ids) into the DFlash2 backbone.

    The convolutions start as identity and the successor codebook at zero, so the result drafts
    exactly as that DFlash draft does; training then only has to add what DFlash2 adds.
    """
    copy_draft(model, dflash_dir, target_layer_ids,
               own_only=lambda k: k.startswith("candidate_selector.") or "_conv." in k)


def train_dflash2(
    target_dir: str | Path,
    sequences: np.ndarray,
    prompt_len: int | np.ndarray,
    out_dir: str | Path,
    shape: DFlash2Shape = DFlash2Shape(),
    settings: TrainSettings = TrainSettings(lr=6e-4),
    batch: int = 4,
    init_from: str | Path | None = None,
    lengths: np.ndarray | None = None,
) -> Path:
    """Train on ``sequences`` [N, S] (prompt + target-generated response); save the draft.
    ``prompt_len`` is one length or one per row; ``lengths``: valid tokens per right-padded row.
    ``init_from``: a trained DFlash draft folder whose weights start the backbone."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = load_frozen_target(target_dir, dtype=target_dtype(settings))
    cfg = new_dflash2_config(target_dir, out_dir, shape)
    model = init_dflash2(cfg, settings.seed)
    if init_from is not None:
        warm_start(model, init_from, cfg.target_layer_ids)
    capture = Capture(tuple(cfg.target_layer_ids))
    rows = anchor_rows(sequences, prompt_len, cfg.block_size, lengths)

    def make_batch(step: int, rank: int):
        return anchor_batch(rows, step, rank, settings.seed, batch, shape.anchors_per_sequence)

    def loss_fn(model, batch_data):
        ids, anchors = on_device(batch_data, target)
        features, _ = capture_batch(target, ids, capture)
        loss, metrics = dflash2_loss(model, target, features, ids, anchors, cfg, shape.selector_weight)
        return loss, ids.numel(), {k: float(v) for k, v in metrics.items()}

    train(Objective(model, loss_fn), make_batch, call_objective, settings, out_dir / "checkpoint", description="dflash2")
    if not is_main_process():
        return out_dir
    save_dflash2(model, out_dir)
    (out_dir / "training.json").write_text(json.dumps({"shape": asdict(shape), "settings": asdict(settings),
                                                        "batch": batch, **sequence_summary(rows),
                                                        "init_from": None if init_from is None else Path(init_from).name}, indent=1))
    return out_dir
