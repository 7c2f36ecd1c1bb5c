"""``backend.compile: auto`` keeps a CPU weight layout (stored transposed or packed for oneDNN on
PyTorch, stored transposed on MLX) only where it is measured faster at load (core/timing.py). These tests time
for real: a layout made slow on purpose must be measured slower and turned down."""

from __future__ import annotations

import functools
import json
import time

import pytest

from speculant.core import timing


def under_load(test):
    """Run a timing test up to three times: another test on the other core (pytest-xdist) can stall
    one measurement. A layout that is really measured wrong fails all three."""
    @functools.wraps(test)
    def run(**fixtures):
        for attempt in range(3):
            try:
                return test(**fixtures)
            except AssertionError:
                if attempt == 2:
                    raise
                if "monkeypatch" in fixtures:
                    fixtures["monkeypatch"].undo()
    return run


@pytest.fixture
def one_thread(torch_threads):
    """PyTorch on one thread for this test, whatever an earlier test on this worker left set
    (training sets two): with two, idle OpenMP workers woke 2-6 ms late after each sleep of the
    slowed layout and made the other one look slow (CI failed so, 2026-12-07)."""
    threads = torch_threads.get_num_threads()
    torch_threads.set_num_threads(1)
    yield torch_threads
    torch_threads.set_num_threads(threads)


def sleeper(seconds: float):
    return lambda: time.sleep(seconds)


@under_load
def test_speedup_is_old_time_over_new_time():
    gains = {name: timing.speedup(sleeper(0.004), new, repeats=3)
             for name, new in (("fast", sleeper(0.001)), ("slow", sleeper(0.008)))}
    assert 2.0 < gains["fast"] < 8.0 and 0.25 < gains["slow"] < 0.8


def test_the_working_set_takes_layers_in_order_up_to_the_budget():
    sizes = [5, 5, 5, 5]
    assert timing.working_set(sizes, lambda n: n, budget=12) == [5, 5, 5]
    assert timing.working_set([100, 1], lambda n: n, budget=12) == [100]  # at least one
    assert timing.working_set(sizes, lambda n: n, budget=1000) == sizes


@under_load
def test_torch_layouts_made_slow_are_measured_slower(monkeypatch, one_thread):
    """One thread (one_thread): after a sleep, oneDNN's idle OpenMP workers took 2-6 ms to wake,
    which made the unslowed packed products look slow."""
    torch = one_thread
    from torch import nn

    from speculant.backends.torch import layouts, packed, transposed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    kinds = ["transposed", "packed"]
    forward = packed.PackedLinear.forward
    monkeypatch.setattr(packed.PackedLinear, "forward", lambda self, x: time.sleep(0.002) or forward(self, x))
    gains = layouts.measured_speedups(list(model), kinds)
    assert gains["packed"] < 0.5 < gains["transposed"], gains
    kind, said = layouts.lay_out(model, torch.float32)
    assert kind in (None, "transposed") and all(type(m) is not packed.PackedLinear for m in model), said
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    monkeypatch.setattr(packed.PackedLinear, "forward", forward)
    monkeypatch.setattr(transposed.TransposedLinear, "forward", lambda self, x: time.sleep(0.002) or x @ self.weight_t)
    gains = layouts.measured_speedups(list(model), kinds)
    assert gains["transposed"] < 0.5 and gains["transposed"] < gains["packed"], gains
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: time.sleep(0.004) or nn.functional.linear(x, self.weight, self.bias))
    kind, said = layouts.lay_out(model, torch.float32)
    assert kind == "packed" and said.startswith("2 linear layers packed for oneDNN"), said  # one-row copies: timed below
    assert all(type(m) is packed.PackedLinear for m in model)


@under_load
def test_dense_one_row_copies_stay_only_where_measured_faster(monkeypatch, one_thread):
    """A packed layer keeps a dense copy of a small weight for one-row products (plain decoding);
    on SmolLM2-135M they made a one-row forward 1.5x slower than packed ones, so they are timed at
    load: made slow on purpose, the slower kind of one-row product must lose."""
    torch = one_thread
    from torch import nn

    from speculant.backends.torch import layouts, packed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    reference = [nn.Linear(64, 96), nn.Linear(96, 64, bias=False)]
    for copy, layer in zip(reference, model):
        copy.load_state_dict(layer.state_dict())
    assert packed.pack_linears(model) == (2, None) and packed.dense_copies(model)[0] == 2
    forward = packed.PackedLinear.packed_forward
    monkeypatch.setattr(packed.PackedLinear, "packed_forward", lambda self, x: time.sleep(0.002) or forward(self, x))
    assert layouts.settle_one_row(model) == "" and packed.dense_copies(model)[0] == 2
    monkeypatch.setattr(packed.PackedLinear, "packed_forward", forward)
    linear = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda *args: time.sleep(0.002) or linear(*args))
    said = layouts.settle_one_row(model)
    assert said.startswith("; one-row products packed too") and packed.dense_copies(model)[0] == 0, said
    monkeypatch.setattr(nn.functional, "linear", linear)
    x = torch.randn(1, 64)
    torch.testing.assert_close(model(x), reference[1](reference[0](x)), rtol=1e-4, atol=1e-4)
    draft = nn.Sequential(nn.Linear(64, 64))  # a drafter follows its target's choice
    assert "also dense" not in layouts.lay_out_like(draft, "packed", one_row_dense=False)
    assert packed.dense_copies(draft)[0] == 0
    assert "also dense" in layouts.lay_out_like(nn.Sequential(nn.Linear(64, 64)), "packed")


@under_load
def test_packed_products_are_timed_through_the_compiled_op_for_compiled_forwards(monkeypatch, one_thread):
    """Under ``on`` packed products run through our own op (packed.packed_product); its cost is
    part of the timing: made slow, packing is measured slower only where it counts."""
    from torch import nn

    from speculant.backends.torch import layouts, packed

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    product = packed.packed_product
    monkeypatch.setattr(packed, "packed_product", lambda *args: time.sleep(0.002) or product(*args))
    compiled = layouts.measured_speedups(list(model), ["packed"], compiled=True)
    assert compiled["packed"] < 0.5, compiled
    eager = layouts.measured_speedups(list(model), ["packed"])
    assert eager["packed"] > compiled["packed"] * 2, (eager, compiled)


@under_load
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


# -- remembered timings (timing.remembered) -------------------------------------------------------

def counting(value):
    calls = []

    def measure():
        calls.append(1)
        return value
    return measure, calls


def test_a_timing_is_measured_once_per_key_and_kept_across_processes(tmp_path, monkeypatch):
    path = tmp_path / "home" / "timings.json"
    monkeypatch.setenv("SPECULANT_TIMINGS", str(path))
    measure, calls = counting({8: 1.5, 1: 0.9})
    assert timing.remembered("split", {"shapes": [[4, 4]]}, measure) == {"8": 1.5, "1": 0.9}  # JSON from the first
    assert timing.remembered("split", {"shapes": [[4, 4]]}, measure) == {"8": 1.5, "1": 0.9}
    assert len(calls) == 1 and path.is_file()
    timing.remembered("split", {"shapes": [[4, 8]]}, measure)  # other layers: timed again
    timing.remembered("layouts", {"shapes": [[4, 4]]}, measure)  # another measurement of the same layers
    monkeypatch.setattr(timing, "machine", lambda: {"cpu": "another"})
    timing.remembered("split", {"shapes": [[4, 4]]}, measure)  # another CPU
    assert len(calls) == 4
    monkeypatch.setenv("SPECULANT_TIMINGS", "off")
    timing.remembered("split", {"shapes": [[4, 4]]}, measure)
    assert len(calls) == 5


def test_the_default_file_is_under_speculant_home(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECULANT_TIMINGS")
    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))
    assert timing.timings_path() == tmp_path / "timings.json"
    timing.remembered("layouts", {}, lambda: 1.25)
    entries = json.loads((tmp_path / "timings.json").read_text())
    assert [entry["value"] for entry in entries.values()] == [1.25]


def test_a_broken_or_unwritable_file_is_timed_around(tmp_path, monkeypatch):
    path = tmp_path / "timings.json"
    path.write_text("{not json")
    monkeypatch.setenv("SPECULANT_TIMINGS", str(path))
    measure, calls = counting(2.0)
    assert timing.remembered("layouts", {}, measure) == 2.0 and len(calls) == 1  # rewritten whole
    assert timing.remembered("layouts", {}, measure) == 2.0 and len(calls) == 1
    blocked = tmp_path / "a file" / "timings.json"
    (tmp_path / "a file").write_text("")  # its folder cannot be made
    monkeypatch.setenv("SPECULANT_TIMINGS", str(blocked))
    assert timing.remembered("layouts", {}, measure) == 2.0 and len(calls) == 2
    assert not list(tmp_path.glob(".timings-*"))


def test_a_second_load_reads_the_layouts_timed_by_the_first(tmp_path, monkeypatch, tiny_target):
    """The target's layouts are timed once: the second load of the same target reads the gains
    (and lays the weights out as the first did) instead of timing them again."""
    import speculant
    from speculant.backends.torch import layouts

    monkeypatch.setenv("SPECULANT_TIMINGS", str(tmp_path / "timings.json"))
    timed, measured = [], layouts.measured_speedups
    monkeypatch.setattr(layouts, "measured_speedups", lambda *a, **k: timed.append(1) or measured(*a, **k))
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(tiny_target)}}
    first, second = (speculant.load_engine(config).target for _ in range(2))
    assert len(timed) == 1 and first.layout == second.layout and first.fast_path == second.fast_path
