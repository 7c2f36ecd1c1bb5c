"""Train a DFlash drafter against a local Hugging Face target.

Objective (block diffusion): random anchor positions in sequences the target generated
itself; each anchor opens the block ``[token[a], mask x (B-1)]`` at positions a..a+B-1; a
block row sees context positions strictly before its anchor and its own block, nothing of
other blocks; row k predicts ``token[a+k]`` with weight ``exp(-(k-1)/gamma)``. Frozen target,
embedding and LM head borrowed from it.
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
from speculant.drafters.dflash.torch import ContextRows
from speculant.training.features import capture_batch, load_frozen_target
from speculant.training.loop import Objective, TrainSettings, call_objective, is_main_process, train

GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class DFlashShape:
    num_layers: int = 2
    block_size: int = 8
    num_features: int = 3
    anchors_per_sequence: int = 32
    target_layer_ids: tuple[int, ...] | None = None  # None: the published spacing for num_features
    # Draft layers attend to the last ``sliding_window - 1`` context rows (None: all). A draft
    # trained on short sequences drafts badly over longer contexts than it saw; a window keeps
    # inference within them, and training honours it, so both see the same rows.
    sliding_window: int | None = None
    mask_token_id: int | None = None  # None: the tokenizer's <|mask|> token


def default_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    from speculant.drafters.dflash.config import default_target_layer_ids

    return default_target_layer_ids(num_target_layers, num_features)


def shape_layer_ids(shape, num_target_layers: int) -> list[int]:
    """The target layers a new draft reads: ``shape.target_layer_ids`` if given, checked against the target."""
    if shape.target_layer_ids is None:
        return default_layer_ids(num_target_layers, shape.num_features)
    ids = list(shape.target_layer_ids)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad or not ids:
        raise ValueError(f"target_layer_ids {ids}: need layer ids in 0..{num_target_layers - 1} "
                         f"(the target has {num_target_layers} layers)")
    return ids


@torch.no_grad()
def generate_sequences(target, prompts: np.ndarray, new_tokens: int, batch: int = 64) -> np.ndarray:
    """Greedy continuations by the target itself (what greedy speculative decoding will see)."""
    out = []
    model = target.model
    for i in range(0, len(prompts), batch):
        ids = torch.from_numpy(prompts[i : i + batch].astype(np.int64)).to(model.device)
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(seq.cpu().numpy().astype(np.int32))
    return np.concatenate(out)


@dataclass
class Blocks:
    """Blocks opened at anchors in one or more sequences laid end to end: the context is every
    row of every sequence, and the mask keeps each block to its own sequence, so a whole batch
    runs as one forward (a GPU step is bound by kernel launches, not by the masked keys)."""
    tokens: torch.Tensor  # [R] every sequence's token ids, one after another
    context_positions: torch.Tensor  # [R] each row's position in its own sequence
    context_sequence: torch.Tensor  # [R] the sequence each row belongs to
    anchor_rows: torch.Tensor  # [n] each anchor's index into ``tokens``
    anchor_positions: torch.Tensor  # [n] its position in its own sequence
    anchor_sequence: torch.Tensor  # [n]

    @classmethod
    def of(cls, tokens: torch.Tensor, anchors: torch.Tensor | list[torch.Tensor]) -> "Blocks":
        """From one sequence [S] and its anchors [n], or a batch [b, S] and a list of anchors per row."""
        if tokens.dim() == 1:
            tokens, anchors = tokens[None], [anchors]
        b, S = tokens.shape
        device = tokens.device
        sequence = torch.cat([torch.full_like(a, i) for i, a in enumerate(anchors)])
        positions = torch.cat(list(anchors))
        return cls(tokens.reshape(-1), torch.arange(S, device=device).repeat(b),
                   torch.arange(b, device=device).repeat_interleave(S), sequence * S + positions, positions, sequence)

    def labels(self, block: int) -> torch.Tensor:
        """[n, B-1]: the tokens each block's rows 1..B-1 should draft."""
        return self.tokens[self.anchor_rows[:, None] + torch.arange(1, block, device=self.tokens.device)[None, :]]

    def previous(self, block: int) -> torch.Tensor:
        """[n, B-1]: the token before each of those (the anchor for row 1)."""
        return self.tokens[self.anchor_rows[:, None] + torch.arange(block - 1, device=self.tokens.device)[None, :]]


def block_mask(anchors: torch.Tensor | Blocks, seq_len: int | None, block: int, window: int | None = None) -> torch.Tensor:
    """Keep-mask [n*B, R + n*B]: context rows of the block's own sequence strictly before its
    anchor, plus its own block. A sliding ``window`` keeps, as inference does, context keys less
    than ``window`` positions before the row (its block is never farther apart). ``anchors``: a
    :class:`Blocks`, or anchors in one sequence of ``seq_len`` tokens."""
    blocks = anchors if isinstance(anchors, Blocks) else Blocks.of(torch.zeros(seq_len, dtype=torch.long,
                                                                               device=anchors.device), anchors)
    n, device = blocks.anchor_rows.shape[0], blocks.anchor_rows.device
    rows_block = torch.arange(n, device=device).repeat_interleave(block)
    anchor = blocks.anchor_positions[rows_block][:, None]
    keys = blocks.context_positions[None, :]
    ctx_keep = (keys < anchor) & (blocks.context_sequence[None, :] == blocks.anchor_sequence[rows_block][:, None])
    if window is not None:
        rows = anchor + torch.arange(block, device=device).repeat(n)[:, None]
        ctx_keep &= rows - keys < window
    own = rows_block[:, None] == rows_block[None, :]
    return torch.cat([ctx_keep, own], dim=1)


@dataclass
class AnchorRows:
    """Training sequences [N, S] (right padded) and, per row, the anchor range ``low..high``:
    from the last prompt token to where a whole block still fits in the row's valid tokens."""
    sequences: np.ndarray
    low: np.ndarray
    high: np.ndarray
    block: int


def anchor_rows(sequences: np.ndarray, prompt_len: int | np.ndarray, block: int,
                lengths: np.ndarray | None = None) -> AnchorRows:
    """Rows of ``sequences`` whose answer holds a whole block; ``prompt_len`` and ``lengths``
    (valid tokens) are per row or, for fixed-shape sequences, one prompt length for all."""
    n, S = sequences.shape
    prompt = np.broadcast_to(np.asarray(prompt_len, dtype=np.int64), (n,))
    valid = np.full(n, S, dtype=np.int64) if lengths is None else np.asarray(lengths, dtype=np.int64)
    low, high = np.maximum(0, prompt - 1), valid - block
    keep = high >= low
    if not keep.any():
        raise ValueError(f"no sequence has {block} tokens after its prompt: generate longer answers or lower --block-size")
    return AnchorRows(sequences[keep], low[keep], high[keep], block)


def anchor_batch(rows: AnchorRows, step: int, rank: int, seed: int, batch: int,
                 anchors_per_sequence: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A deterministic batch for (step, rank): sequence rows, cut to the longest one's blocks,
    and, per row, sorted distinct anchor positions in its ``low..high``."""
    rng = np.random.default_rng([seed, step, rank])
    picked = rng.integers(0, len(rows.sequences), size=batch)
    anchors = []
    for r in picked:
        low, high = int(rows.low[r]), int(rows.high[r])
        count = min(anchors_per_sequence, high - low + 1)
        anchors.append(torch.from_numpy(np.sort(rng.choice(np.arange(low, high + 1), size=count, replace=False))))
    end = int(rows.high[picked].max()) + rows.block  # the last block of the longest row ends here
    ids = torch.from_numpy(rows.sequences[picked, :end].astype(np.int64))
    return ids, anchors


def draft_forward(model, target, features: torch.Tensor, tokens: torch.Tensor, anchors, cfg: DFlashConfig,
                  run_layer=None):
    """Draft hidden states [n, B, H] of the blocks opened at ``anchors``: in one sequence
    (features [S, K*H], tokens [S], anchors [n]) or in a batch (features [b, S, K*H], tokens
    [b, S], a list of anchors per row; n counts them all, row after row).
    ``run_layer(layer, x, cos, sin, context, mask)`` replaces ``layer(...)`` (DFlash2 runs
    its block-local convolutions block by block)."""
    B = cfg.block_size
    blocks = anchors if isinstance(anchors, Blocks) else Blocks.of(tokens, anchors)
    n, device = blocks.anchor_rows.shape[0], features.device
    dtype = next(model.parameters()).dtype
    ctx = model.project_context(features.reshape(-1, features.shape[-1]).to(dtype))
    ctx_cos, ctx_sin = model.rotary(blocks.context_positions, dtype)
    positions = (blocks.anchor_positions[:, None] + torch.arange(B, device=device)[None, :]).reshape(-1)
    cos, sin = model.rotary(positions, dtype)
    ids = torch.full((n, B), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = blocks.tokens[blocks.anchor_rows]
    with torch.no_grad():
        x = target.embed(ids.reshape(-1), raw=True).to(dtype)  # table rows, as inference feeds them
    x = x * cfg.input_embedding_scale
    masks = {window: block_mask(blocks, None, B, window) for window in {layer.window for layer in model.layers}}
    for layer in model.layers:
        mask = masks[layer.window]
        context = ContextRows(*layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin))
        x = layer(x, cos, sin, context, mask) if run_layer is None else run_layer(layer, x, cos, sin, context, mask)
    return model.norm(x).reshape(n, B, -1)


def target_dtype(settings: TrainSettings) -> str | None:
    """float32 for a float32 run (its draft rows meet the target's head unconverted); else the device's default."""
    return None if settings.bf16 else "float32"


def on_device(batch_data, target) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A batch of :func:`anchor_batch` moved to the target's device."""
    ids, anchors = batch_data
    device = target.model.device
    return ids.to(device), [a.to(device) for a in anchors]


def block_loss(model, target, features, tokens, anchors, cfg: DFlashConfig) -> tuple[torch.Tensor, dict]:
    """The decay-weighted cross-entropy of every block (one sequence or a batch, as :func:`draft_forward`)."""
    B = cfg.block_size
    blocks = Blocks.of(tokens, anchors)
    hidden = draft_forward(model, target, features, tokens, blocks, cfg)[:, 1:]
    logits = target._head(hidden).float() * cfg.output_multiplier
    return weighted_block_ce(logits, blocks.labels(B), B)


def weighted_block_ce(logits: torch.Tensor, labels: torch.Tensor, B: int) -> tuple[torch.Tensor, dict]:
    """Cross-entropy of block rows 1..B-1 ([n, B-1, V] vs [n, B-1]), weight exp(-(k-1)/gamma)."""
    gamma = GAMMA.get(B, max(1.0, B / 2))
    weights = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=labels.device) / gamma).expand_as(labels)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(labels)
    loss = (ce * weights).sum() / weights.sum()
    accuracy = (logits.argmax(-1) == labels).float().mean(0)
    return loss, {"acc1": accuracy[0].detach()}  # a tensor: no device sync per sequence


def sequence_summary(rows: AnchorRows) -> dict:
    """What training.json says about the sequences trained on."""
    return {"sequences": int(len(rows.sequences)), "sequence_length": int(rows.sequences.shape[1]),
            "answer_tokens_anchorable": int((rows.high - rows.low + 1).sum())}


def init_draft(cfg: DFlashConfig, seed: int):
    from speculant.drafters.dflash.torch import DFlashModel

    torch.manual_seed(seed)
    model = DFlashModel(cfg)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, 0.0, 0.02)
    return model


def copy_draft(model, draft_dir: str | Path, target_layer_ids: list[int], own_only=lambda name: False) -> None:
    """Start ``model`` from a trained DFlash draft of the same target: same target layer ids, and
    every tensor present with its shape, except those ``own_only(name)`` keeps as initialised."""
    from safetensors.torch import load_file

    source_ids = json.loads((Path(draft_dir) / "config.json").read_text()).get("dflash_config", {}).get("target_layer_ids")
    if source_ids != list(target_layer_ids):
        raise ValueError(f"{draft_dir} reads target layers {source_ids}, this draft {list(target_layer_ids)}; "
                         "pass the same --target-layer-ids")
    source = load_file(str(Path(draft_dir) / "model.safetensors"))
    own = model.state_dict()
    problems = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape) if k in own else 'absent'}"
                for k, v in source.items() if k not in own or own[k].shape != v.shape]
    problems += [f"{k} absent from the DFlash draft" for k in own if k not in source and not own_only(k)]
    if problems:
        raise ValueError(f"{draft_dir} does not match this draft's shape: " + "; ".join(problems[:5]))
    with torch.no_grad():
        for k, v in source.items():
            own[k].copy_(v.to(own[k].dtype))


def mask_token_id(target_dir: Path, drafter: str = "DFlash", chosen: int | None = None) -> int:
    """The block's placeholder id: ``chosen`` (--mask-token-id) or the target tokenizer's
    ``<|mask|>`` token."""
    if chosen is not None:
        vocab = text_config(json.loads((target_dir / "config.json").read_text()))["vocab_size"]
        if not 0 <= chosen < vocab:
            raise ValueError(f"--mask-token-id {chosen}: need an id in 0..{vocab - 1} (the target's embedding rows)")
        return chosen
    tok = json.loads((target_dir / "tokenizer.json").read_text())
    mask = next((t["id"] for t in tok.get("added_tokens", []) if t["content"] in ("<|mask|>", "<|MASK|>")), None)
    if mask is None:
        raise ValueError(f"{target_dir} tokenizer has no <|mask|> token; pass --mask-token-id with an id the "
                         f"target never writes (e.g. an unused special token; {drafter} needs a mask id inside the vocab)")
    return mask


def new_draft_config(target_dir: Path, out_dir: Path, shape: DFlashShape) -> DFlashConfig:
    tcfg = text_config(json.loads((target_dir / "config.json").read_text()))  # composite: the text part
    mask = mask_token_id(target_dir, chosen=shape.mask_token_id)
    layer_ids = shape_layer_ids(shape, tcfg["num_hidden_layers"])
    out_dir.mkdir(parents=True, exist_ok=True)
    config = published_config(tcfg, mask, layer_ids, shape.num_layers, shape.block_size, shape.sliding_window,
                              is_causal=False)  # the block is denoised bidirectionally, as trained
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    cfg, problems = parse_config(out_dir)
    if problems:
        raise ValueError("; ".join(map(str, problems)))
    return cfg


def train_dflash(
    target_dir: str | Path,
    sequences: np.ndarray,
    prompt_len: int | np.ndarray,
    out_dir: str | Path,
    shape: DFlashShape = DFlashShape(),
    settings: TrainSettings = TrainSettings(lr=6e-4),
    batch: int = 4,
    init_from: str | Path | None = None,
    lengths: np.ndarray | None = None,
) -> Path:
    """Train on ``sequences`` [N, S] (prompt + target-generated response); save the draft.
    ``prompt_len`` is one length or one per row; ``lengths``: valid tokens per right-padded row
    (default: all S). ``init_from``: a trained DFlash draft folder (same target and shape) to
    continue from, e.g. on new data; its optimiser state is not carried over."""
    from safetensors.torch import save_file

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = load_frozen_target(target_dir, dtype=target_dtype(settings))
    cfg = new_draft_config(target_dir, out_dir, shape)
    model = init_draft(cfg, settings.seed)
    if init_from is not None:
        copy_draft(model, init_from, cfg.target_layer_ids)
    capture = Capture(tuple(cfg.target_layer_ids))
    rows = anchor_rows(sequences, prompt_len, cfg.block_size, lengths)  # anchors in the answer (or its last prompt token)

    def make_batch(step: int, rank: int):
        return anchor_batch(rows, step, rank, settings.seed, batch, shape.anchors_per_sequence)

    def loss_fn(model, batch_data):
        ids, anchors = on_device(batch_data, target)
        features, _ = capture_batch(target, ids, capture)
        loss, metrics = block_loss(model, target, features, ids, anchors, cfg)  # the whole batch in one forward
        return loss, ids.numel(), {"acc1": float(metrics["acc1"])}

    # through Objective.forward, so data-parallel runs average the gradients
    train(Objective(model, loss_fn), make_batch, call_objective, settings, out_dir / "checkpoint", description="dflash")
    if not is_main_process():
        return out_dir
    state = {k: v.detach().contiguous().cpu().float() for k, v in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "training.json").write_text(json.dumps({"shape": asdict(shape), "settings": asdict(settings),
                                                        "batch": batch,
                                                        **sequence_summary(rows),
                                                        "init_from": None if init_from is None else Path(init_from).name},
                                                       indent=1))
    return out_dir
