"""MLX products split over the CPU's cores (speculant/backends/mlx/split.py): the same products
as whole layers, from any thread, kept only where measured to pay, and lossless in an engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import speculant

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx


def engine(compile: str):
    from speculant.embedded import PAIR_DIR

    return speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": compile},
                                  "target": {"path": str(PAIR_DIR / "target")},
                                  "drafter": {"kind": "dflash", "path": str(PAIR_DIR / "dflash"), "block_size": 8}})


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_split_products_equal_the_whole_ones(parts, bias):
    import mlx.core as mx
    import mlx.nn as nn

    from speculant.backends.mlx.layout import TransposedLinear
    from speculant.backends.mlx.split import SplitLinear

    linear = nn.Linear(96, 301, bias=bias)
    whole = TransposedLinear(linear)
    split = SplitLinear(whole, parts)
    assert [b.shape[1] for b in split.blocks] == ([150, 151] if parts == 2 else [100, 101, 100])
    for rows in (1, 8):
        x = mx.random.normal((rows, 96), key=mx.random.key(rows))
        np.testing.assert_allclose(np.array(split(x)), np.array(whole(x)), rtol=1e-6, atol=1e-6)
    got = [None]
    worker = threading.Thread(target=lambda: got.__setitem__(0, np.array(split(x))))  # streams are per thread
    worker.start()
    worker.join()
    np.testing.assert_allclose(got[0], np.array(whole(x)), rtol=1e-6, atol=1e-6)
    restored = split.to_linear()
    assert mx.array_equal(restored.weight, linear.weight).item()
    assert mx.array_equal(split.weight, linear.weight).item()


def test_on_splits_target_and_draft_and_stays_lossless(monkeypatch):
    from speculant.backends.mlx import split

    monkeypatch.setattr(split, "usable_cores", lambda: 2)
    fast, plain = engine("on"), engine("off")
    assert "split over 2 cores" in fast.target.fast_path and "split over 2 cores" in fast.drafter.fast_path
    assert "the head split" in fast.target.fast_path
    ids = list(range(10, 60))
    got = fast.run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True)
    want = plain.without_drafter().run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True)
    assert got.token_ids == want.token_ids
    assert got.stats.acceptance_lengths == plain.run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True).stats.acceptance_lengths


def test_auto_keeps_layers_whole_where_splitting_measured_no_faster(monkeypatch):
    from speculant.backends.mlx import split
    from speculant.backends.mlx.split import SplitLinear

    monkeypatch.setattr(split, "usable_cores", lambda: 2)
    monkeypatch.setattr(split, "measured_speedups", lambda layers, parts: {1: 1.4, 8: 0.97})
    e = engine("auto")
    assert "products split over 2 cores measured no faster (0.97x)" in e.target.fast_path
    assert e.target.split_rows is None and "split" not in e.drafter.fast_path
    assert not any(isinstance(m, SplitLinear) for _, m in e.target.model.named_modules())


def test_one_row_products_stay_whole_where_only_blocks_pay(monkeypatch):
    """Split products for verify blocks, one-row steps in turn on one stream: the same results."""
    import mlx.core as mx

    from speculant.backends.mlx import split
    from speculant.backends.mlx.split import SplitLinear

    monkeypatch.setattr(split, "usable_cores", lambda: 2)
    monkeypatch.setattr(split, "measured_speedups", lambda layers, parts: {1: 0.9, 8: 1.3})
    e = engine("auto")
    assert e.target.split_rows == 2 and "one-row products whole (split measured 0.90x)" in e.target.fast_path
    layers = [m for _, m in e.target.model.named_modules() if isinstance(m, SplitLinear)]
    drafts = [m for _, m in e.drafter.model.named_modules() if isinstance(m, SplitLinear)]
    assert layers and all(m.split_rows == 2 for m in layers + drafts)
    for rows in (1, 8):
        x = mx.random.normal((rows, layers[0].blocks[0].shape[0]), key=mx.random.key(rows))
        whole = x @ layers[0].weight_t
        np.testing.assert_allclose(np.array(layers[0](x)), np.array(whole), rtol=1e-6, atol=1e-6)
    ids = list(range(10, 60))
    plain = engine("off").without_drafter().run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True)
    assert e.run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True).token_ids == plain.token_ids
    assert e.without_drafter().run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True).token_ids == plain.token_ids


def test_one_core_leaves_products_whole(monkeypatch):
    from speculant.backends.mlx import split

    monkeypatch.setattr(split, "usable_cores", lambda: 1)
    e = engine("on")
    assert "split" not in e.target.fast_path and e.target.split_rows is None
