"""The cycle classes of benchmarks/loop_acceptance.py (new loop / known loop / other)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SPEC = importlib.util.spec_from_file_location("loop_acceptance", Path(__file__).parents[1] / "benchmarks" / "loop_acceptance.py")
loop_acceptance = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(loop_acceptance)


def test_anchors_are_classed_by_the_eight_tokens_ending_there():
    unit = list(range(100, 110))  # 10 tokens, then the same 10 again
    sequence = [1, 2, 3] + unit + unit
    first_end, repeat_end = 3 + 9, 3 + 19  # last token of the first and of the repeated unit
    anchors = [5, first_end, repeat_end, repeat_end - 2, repeat_end - 3]
    nothing_trained = np.array([], dtype=np.uint64)
    assert loop_acceptance.anchor_classes(sequence, anchors, nothing_trained) == [
        "other",  # fewer than 8 tokens before it
        "other",  # first occurrence
        "new loop", "new loop",  # repeats, and no training sequence holds them
        "other",  # the 8 tokens ending here straddle the two copies: seen once only
    ]
    trained = np.unique(loop_acceptance.ngram_hashes(np.asarray([unit])).ravel())
    classes = loop_acceptance.anchor_classes(sequence, anchors, trained)
    assert classes[2:4] == ["known loop", "known loop"] and classes[:2] == ["other", "other"]
