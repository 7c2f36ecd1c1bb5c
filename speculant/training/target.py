"""Pretrain a small Qwen3 causal LM on the Python corpus, saved with ``save_pretrained``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from speculant.training.loop import TrainSettings, is_main_process, train


@dataclass
class TargetShape:
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    max_position_embeddings: int = 2048


def encode_corpus(tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream, files separated by the end-of-text token."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoding)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def make_model(tokenizer, shape: TargetShape, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        **asdict(shape),
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def window_batch(stream: np.ndarray, step: int, rank: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, step, rank])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([stream[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def train_target(
    tokenizer_dir: str | Path,
    stream: np.ndarray,
    out_dir: str | Path,
    shape: TargetShape = TargetShape(),
    settings: TrainSettings = TrainSettings(),
    batch: int = 8,
    seq_len: int = 256,
) -> Path:
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = make_model(tokenizer, shape, settings.seed)

    def loss_fn(model, ids: torch.Tensor):
        out = model(input_ids=ids, labels=ids, use_cache=False)
        return out.loss, ids.numel(), {}

    train(
        model,
        lambda step, rank: window_batch(stream, step, rank, batch, seq_len, settings.seed),
        loss_fn,
        settings,
        out_dir / "checkpoint",
        description="target",
    )
    if not is_main_process():
        return out_dir / "model"
    model.save_pretrained(str(out_dir / "model"), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir / "model"))
    (out_dir / "model" / "training.json").write_text(json.dumps({
        "shape": asdict(shape), "settings": asdict(settings), "batch": batch, "seq_len": seq_len,
        "train_tokens_seen": settings.steps * batch * seq_len, "corpus_tokens": int(len(stream)),
    }, indent=1))
    return out_dir / "model"
