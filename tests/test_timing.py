"""``backend.compile: auto`` keeps a CPU weight layout (packed for oneDNN on PyTorch, stored
transposed on MLX) only where it is measured faster at load (core/timing.py). These tests time
for real: a layout made slow on purpose must be measured slower and turned down."""

from __future__ import annotations

import time

import pytest

from speculant.core import timing


def sleeper(seconds: float):
    return lambda: time.sleep(seconds)


def test_speedup_is_old_time_over_new_time_weighted_by_layer_count():
    fast, slow = sleeper(0.001), sleeper(0.004)
    assert 2.0 < timing.speedup([(1, fast, slow)], repeats=3) < 8.0
    assert timing.speedup([(1, slow, fast)], repeats=3) < 0.5
    # one shape shared by 9 layers outweighs one layer of another shape
    mixed = timing.speedup([(9, fast, slow), (1, slow, fast)], repeats=3)
    assert 1.5 < mixed < (9 * 4 + 1) / (9 * 1 + 4) * 1.6


def test_packing_made_slow_is_measured_slower_and_turned_down(monkeypatch):
    torch = pytest.importorskip("torch")
    from torch import nn

    from speculant.backends.torch import packed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    forward = packed.PackedLinear.forward
    monkeypatch.setattr(packed.PackedLinear, "forward", lambda self, x: time.sleep(0.002) or forward(self, x))
    count, problem = packed.pack_linears(model, measure=True)
    assert count == 0 and "measured no faster than dense ones" in problem, problem
    assert all(type(m) is nn.Linear for m in model)
    monkeypatch.setattr(packed.PackedLinear, "forward", forward)
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: time.sleep(0.002) or nn.functional.linear(x, self.weight, self.bias))
    assert packed.pack_linears(model, measure=True) == (2, None)  # now the dense layers are the slow ones
    assert all(type(m) is packed.PackedLinear for m in model)


def test_transposing_made_slow_is_measured_slower_and_turned_down(monkeypatch):
    pytest.importorskip("mlx.core")
    import mlx.core as mx
    import mlx.nn as nn

    from speculant.backends.mlx import layout

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    call = layout.TransposedLinear.__call__
    monkeypatch.setattr(layout.TransposedLinear, "__call__", lambda self, x: time.sleep(0.002) or call(self, x))
    count, problem = layout.transpose_linears(model, measure=True)
    assert count == 0 and "measured no faster than the layout as loaded" in problem, problem
    assert all(type(m) is nn.Linear for m in model.layers)
    monkeypatch.setattr(layout.TransposedLinear, "__call__", call)
    linear_call = nn.Linear.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: time.sleep(0.002) or linear_call(self, x))
    assert layout.transpose_linears(model, measure=True) == (2, None)
    assert all(type(m) is layout.TransposedLinear for m in model.layers)
    assert mx.array_equal(model.layers[1].weight_t.T, model.layers[1].weight).item()
