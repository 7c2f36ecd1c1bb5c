"""The CPU's ``backend.compile`` on PyTorch where storing weights transposed is measured fastest
(``auto``) or asked for (``on``): the target's and the draft's float32 ``nn.Linear`` layers
become ``TransposedLinear`` (backends/torch/transposed.py), in eager and compiled forwards. Only
the rounding may change: the same tokens and acceptance lengths as the layers as loaded, each
layer checked at load, the layers as loaded back exactly where one disagrees, and a tied head
still tied to its embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import speculant
from layout_helpers import PROMPT, assert_laid_out, assert_same_speculation
from speculant.backends.torch import layouts
from speculant.backends.torch.packed import PackedLinear
from speculant.backends.torch.transposed import TransposedLinear, transpose_linears


def measured(gains):
    return lambda linears, kinds, **_: {kind: gains[kind] for kind in kinds}


@pytest.fixture(autouse=True)
def transposing_pays(monkeypatch):
    """Which layout pays is measured at load and depends on the CPU; these tests check what
    transposing does, so they take it as measured fastest (test_timing.py measures for real)."""
    monkeypatch.setattr(layouts, "measured_speedups", measured({"transposed": 2.0, "packed": 1.5}))


def engine(target, compile="auto", draft=None, dtype="float32"):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": dtype, "compile": compile},
              "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": "dflash", "path": str(draft)}
    return speculant.load_engine(config)


def layers(model, kind):
    return [m for m in model.modules() if type(m) is kind]


def test_auto_transposes_the_target_and_draft_and_changes_no_token(planted_pair):
    fast_engine = engine(planted_pair["target"], "auto", planted_pair["draft"])
    dense_engine = engine(planted_pair["target"], "off", planted_pair["draft"])
    assert_laid_out(fast_engine, layers, nn.Linear, TransposedLinear)
    assert fast_engine.target.layout == "transposed"
    assert "linear layers stored transposed (backend.compile=auto on cpu)" in fast_engine.target.fast_path
    assert fast_engine.drafter.net.fast_path.startswith("eager; ") and "stored transposed" in fast_engine.drafter.net.fast_path
    assert_same_speculation(fast_engine, dense_engine)


def test_the_fastest_layout_measured_is_the_one_kept(planted_pair, monkeypatch):
    monkeypatch.setattr(layouts, "measured_speedups", measured({"transposed": 1.2, "packed": 1.6}))
    eng = engine(planted_pair["target"], "auto")
    assert eng.target.layout == "packed" and layers(eng.target.model, PackedLinear)
    assert layers(eng.target.model, TransposedLinear) == []
    monkeypatch.setattr(layouts, "measured_speedups", measured({"transposed": 1.04, "packed": 0.9}))
    eng = engine(planted_pair["target"], "auto")  # under the margin: as loaded
    assert eng.target.layout is None and "(transposed 1.04x, packed 0.90x)" in eng.target.fast_path


@pytest.mark.slow
@pytest.mark.compiler("aot_eager")  # the graphs traced over TransposedLinear; inductor's code: test_fast_path_torch.py
def test_compiled_forwards_run_over_transposed_weights_and_change_no_token(planted_pair, monkeypatch):
    """``on`` times the layouts as ``auto`` does, and compiles the target and the draft step over
    the transposed weights where they are timed fastest (packed ones: test_fast_path_torch.py)."""
    asked = []
    monkeypatch.setattr(layouts, "measured_speedups",
                        lambda linears, kinds, compiled=False: asked.append((kinds, compiled)) or measured({"transposed": 1.2, "packed": 1.1})(linears, kinds))
    fast_engine = engine(planted_pair["target"], "on", planted_pair["draft"])
    dense_engine = engine(planted_pair["target"], "off", planted_pair["draft"])
    assert fast_engine.target.layout == "transposed" and layers(fast_engine.target.model, nn.Linear) == []
    assert layers(fast_engine.drafter.net.model, TransposedLinear)
    said = fast_engine.target.fast_path
    assert said.startswith("compiled: widths") and said.endswith("linear layers stored transposed"), said
    assert fast_engine.drafter.net.fast_path.startswith("compiled draft")
    assert fast_engine.drafter.net.fast_path.endswith("linear layers stored transposed")
    assert_same_speculation(fast_engine, dense_engine)
    assert fast_engine.target._steps.recompiles == 0 and asked == [(["transposed", "packed"], True)]
    monkeypatch.setattr(layouts, "measured_speedups", measured({"transposed": 0.9, "packed": 0.8}))
    dense_compiled = engine(planted_pair["target"], "on")
    said = dense_compiled.target.fast_path
    assert said.startswith("compiled: widths 1;") and dense_compiled.target.layout is None, said
    assert said.endswith("; linear weights as loaded (no CPU weight layout was measured faster than dense "
                         "weights on this CPU (transposed 0.90x, packed 0.80x))"), said


def test_a_tied_head_reads_a_transposed_copy_and_stays_tied(tmp_path, torch_threads):
    from speculant.testing.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    fast, slow = engine(target, "auto"), engine(target, "off")
    head, embedding = fast.target.model.get_output_embeddings(), fast.target.model.get_input_embeddings()
    assert isinstance(head, TransposedLinear) and type(embedding) is nn.Embedding
    assert torch.equal(head.weight, embedding.weight)
    logits = []
    for e in (fast, slow):
        e.target.reset()
        e.target.prefill(PROMPT)
        logits.append(e.target.forward(e.backend.int_array([9, 10, 11])).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True)
    assert fast.run(**kwargs).token_ids == slow.run(**kwargs).token_ids


def test_a_layer_that_disagrees_puts_every_layer_back_as_loaded(tmp_path, torch_threads, monkeypatch):
    """The check fails on the fourth layer: the three swapped before it go back to nn.Linear with
    the weights they were loaded with, and the tied head to the embedding's own weight."""
    from speculant.testing.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "tied", seed=2, tie_word_embeddings=True)
    forward, calls = TransposedLinear.forward, []

    def fourth_is_off(self, x):
        calls.append(self)
        return forward(self, x) * (1.01 if len({id(c) for c in calls}) == 4 else 1.0)

    monkeypatch.setattr(TransposedLinear, "forward", fourth_is_off)
    eng, off = engine(target, "auto"), engine(target, "off")
    assert "the transposed product is" in eng.target.fast_path and "off the dense one" in eng.target.fast_path
    assert eng.target.layout is None and layers(eng.target.model, TransposedLinear) == []
    model = eng.target.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for got, want in zip(layers(model, nn.Linear), layers(off.target.model, nn.Linear)):
        assert torch.equal(got.weight, want.weight) and got.weight.is_contiguous()


def test_not_laid_out_in_bfloat16(planted_pair):
    bf16 = engine(planted_pair["target"], "auto", dtype="bfloat16")
    assert bf16.target.layout is None and layers(bf16.target.model, TransposedLinear) == []
    assert "CPU weight layouts are float32 only, not bfloat16" in bf16.target.fast_path


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_products_round_like_dense_ones(bias):
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(96, 200, bias=bias))
    dense = holder[0]
    assert transpose_linears(holder) == (1, None)
    layer = holder[0]
    assert isinstance(layer, TransposedLinear) and torch.equal(layer.weight, dense.weight)
    assert torch.equal(layer.to_linear().weight, dense.weight)
    for rows in (1, 3, 8, 17):
        x = torch.randn(2, rows, 96)
        torch.testing.assert_close(layer(x), dense(x), rtol=1e-5, atol=1e-5)


def test_the_originals_are_released_as_they_are_swapped(monkeypatch):
    """Memory: no list keeps an original weight alive once its layer is transposed (a tied one
    stays with the module that shares it)."""
    import gc
    import weakref

    holder = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32))
    originals = [weakref.ref(layer.weight) for layer in holder]
    seen = []
    init = TransposedLinear.__init__

    def note_alive(self, linear):
        gc.collect()
        seen.append([ref() is not None for ref in originals])
        init(self, linear)

    monkeypatch.setattr(TransposedLinear, "__init__", note_alive)
    assert transpose_linears(holder) == (2, None)
    gc.collect()
    assert seen == [[True, True], [False, True]] and all(ref() is None for ref in originals)
