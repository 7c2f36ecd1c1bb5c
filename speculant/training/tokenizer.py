"""A byte-level BPE tokenizer trained with ``tokenizers`` and saved as ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 8192):
    """Train and save; the end-of-text token is id 0 and the mask token id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, mask_token=MASK_TOKEN)
    fast.save_pretrained(str(out_dir))
    return fast
