"""Shared by the training tests: the tiny corpus, and the check that a trained drafter is lossless."""

from __future__ import annotations

import numpy as np

import speculant

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
] * 20


def lossless_acceptance(target, kind: str, draft, sequences: np.ndarray, rows: int = 4) -> float:
    """Mean acceptance length of ``draft`` over the first ``rows`` sequences' 8-token prompts,
    asserting on the way that every output equals plain greedy decoding."""
    spec = speculant.load_engine({"target": {"path": str(target)}, "drafter": {"kind": kind, "path": str(draft)}})
    plain = speculant.load_engine({"target": {"path": str(target)}})
    taus = []
    for row in range(rows):
        prompt = sequences[row, :8].tolist()
        result = spec.run(prompt_ids=prompt, max_new_tokens=32, ignore_eos=True)
        assert result.token_ids == plain.run(prompt_ids=prompt, max_new_tokens=32, ignore_eos=True).token_ids
        taus.append(result.stats.mean_acceptance_length)
    return float(np.mean(taus))
