"""The CPU's ``backend.compile: auto`` on PyTorch where packing is measured fastest: the target's
and the draft's ``nn.Linear`` layers reordered once for oneDNN (backends/torch/packed.py). Only the rounding may change: the
same tokens as the dense layers (plain and speculative, with the same acceptance lengths), each
layer checked at load, and the dense layers kept, with the reason, where packing fails."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import speculant
from layout_helpers import PROMPT, assert_laid_out, assert_same_speculation
from speculant.backends.torch import layouts, packed
from speculant.backends.torch.packed import PackedLinear, pack_linears


@pytest.fixture(autouse=True)
def packing_pays(monkeypatch):
    """Which layout pays is measured at load and depends on the CPU; these tests check what
    packing does, so they take it as measured fastest (test_timing.py measures for real)."""
    monkeypatch.setattr(layouts, "measured_speedups", lambda linears, kinds, **_: {"transposed": 1.5, "packed": 2.0})


def engine(pair, compile, draft=True, dtype="float32"):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": dtype, "compile": compile},
              "target": {"path": str(pair["target"])}}
    if draft:
        config["drafter"] = {"kind": "dflash", "path": str(pair["draft"])}
    return speculant.load_engine(config)


def layers(model, kind):
    return [m for m in model.modules() if type(m) is kind]


def test_auto_packs_the_target_and_draft_and_changes_no_token(planted_pair):
    packed_engine, dense_engine = engine(planted_pair, "auto"), engine(planted_pair, "off")
    assert_laid_out(packed_engine, layers, nn.Linear, PackedLinear)
    assert "packed for oneDNN" in packed_engine.target.fast_path
    assert "packed for oneDNN" in packed_engine.drafter.net.fast_path
    assert layers(dense_engine.target.model, PackedLinear) == []
    assert_same_speculation(packed_engine, dense_engine)


def test_not_packed_in_bfloat16_and_the_reason_is_shown(planted_pair):
    bf16 = engine(planted_pair, "auto", draft=False, dtype="bfloat16")
    assert bf16.target.fast_path.startswith("eager: CPU weight layouts are float32 only, not bfloat16")
    assert layers(bf16.target.model, PackedLinear) == []


def test_a_layer_that_disagrees_keeps_every_layer_dense(planted_pair, monkeypatch):
    def off_by_a_little(self, x):
        return nn.functional.linear(x, self.dense if self.dense is not None else torch.zeros(1), self.bias) * 1.01

    monkeypatch.setattr(PackedLinear, "forward", off_by_a_little)
    eng = engine(planted_pair, "auto", draft=False)
    assert eng.target.fast_path.startswith("eager: packing the linear weights failed (ValueError:"), eng.target.fast_path
    assert "off the dense one" in eng.target.fast_path
    assert layers(eng.target.model, PackedLinear) == [] and layers(eng.target.model, nn.Linear)
    assert eng.target.layout is None


def test_no_layout_measured_faster_keeps_the_dense_layers_and_says_so(planted_pair, monkeypatch):
    measured = []
    monkeypatch.setattr(layouts, "measured_speedups",
                        lambda linears, kinds, **_: measured.append((linears, kinds)) or {"transposed": 0.96, "packed": 0.97})
    eng = engine(planted_pair, "auto")
    said = "no CPU weight layout was measured faster than dense weights on this CPU (transposed 0.96x, packed 0.97x)"
    assert said in eng.target.fast_path, eng.target.fast_path
    assert layers(eng.target.model, PackedLinear) == [] and eng.target.layout is None
    assert eng.drafter.net.fast_path == "eager"
    linears, kinds = measured[0]
    assert len(measured) == 1 and kinds == ["transposed", "packed"]
    every = [m for m in eng.target.model.modules() if type(m) is nn.Linear]
    assert len(linears) == len(every) and {id(m) for m in linears} == {id(m) for m in every}


@pytest.mark.parametrize("shape", [(64, 96), (1024, 4200)])  # under and over DENSE_ONE_ROW_BYTES
def test_packed_products_round_like_dense_ones(shape):
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(*shape, bias=True))
    dense = holder[0]
    assert pack_linears(holder) == (1, None)
    layer = holder[0]
    big = shape[0] * shape[1] * 4 >= packed.DENSE_ONE_ROW_BYTES
    assert (layer.dense is None) == big  # a large dense weight is released
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, shape[0])
        torch.testing.assert_close(layer(x), dense(x), rtol=1e-4, atol=1e-4)
    x = torch.randn(2, 5, shape[0])  # batched rows keep their shape
    torch.testing.assert_close(layer(x), dense(x), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(64, 96), (1024, 4200)])  # with and without a dense one-row copy
def test_compiled_graphs_run_packed_products(shape, torch_threads):
    """Inductor cannot lower oneDNN's product over a weight it did not pack itself; the layer's
    own op (packed.packed_product) runs it inside a compiled graph, on one row and on several."""
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(*shape, bias=True))
    dense = holder[0]
    assert pack_linears(holder) == (1, None)
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(1, rows, shape[0])
            graph = torch.compile(holder[0], fullgraph=True, dynamic=False)
            torch.testing.assert_close(graph(x), dense(x), rtol=1e-4, atol=1e-4)
            torch._dynamo.reset()


def test_the_mtp_draft_is_packed_with_its_target(tmp_path, torch_threads):
    from speculant.testing.tiny import build_tiny_target
    from speculant.testing.tiny_mtp import build_tiny_mtp

    target = build_tiny_target(tmp_path / "target", seed=0, planted=7.5)
    build_tiny_mtp(target, seed=3)

    def mtp(compile):
        return speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32",
                                                  "compile": compile},
                                      "target": {"path": str(target)}, "drafter": {"kind": "mtp"}})

    fast, slow = mtp("auto"), mtp("off")
    assert "packed for oneDNN" in fast.drafter.net.fast_path and slow.drafter.net.fast_path == "eager"
    assert layers(fast.drafter.net.model, nn.Linear) == [] and layers(fast.drafter.net.model, PackedLinear)
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=32, ignore_eos=True)
    a, b = fast.run(**kwargs), slow.run(**kwargs)
    assert a.token_ids == b.token_ids and a.stats.acceptance_lengths == b.stats.acceptance_lengths
