"""The CPU's ``backend.compile`` on MLX: the target's and the draft's float32 ``nn.Linear`` layers
stored transposed (backends/mlx/layout.py). The products are the same: the same tokens as the
layers as loaded (plain and speculative, with the same acceptance lengths), each layer checked at
load, and the layers as loaded kept, with the reason, where a product disagrees."""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from layout_helpers import PROMPT, assert_laid_out, assert_same_speculation

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from speculant.backends.mlx import layout  # noqa: E402
from speculant.backends.mlx.layout import TransposedLinear, TransposedTiedEmbedding, transpose_linears  # noqa: E402


@pytest.fixture(autouse=True)
def transposing_pays(monkeypatch):
    """Whether transposing pays is measured at load and depends on the CPU; these tests check
    what it does, so they take it as measured to pay (test_timing.py measures for real)."""
    monkeypatch.setattr(layout, "measured_speedup", lambda pairs: 2.0)


def engine(target, compile="auto", draft=None, dtype="float32", kind="dflash"):
    config = {"backend": {"kind": "mlx", "device": "cpu", "dtype": dtype, "compile": compile},
              "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": kind, "path": str(draft)}
    return speculant.load_engine(config)


def layers(model, kind):
    return [m for _, m in model.named_modules() if type(m) is kind]


def test_auto_transposes_the_target_and_draft_and_changes_no_token(planted_pair):
    fast_engine = engine(planted_pair["target"], "auto", planted_pair["draft"])
    dense_engine = engine(planted_pair["target"], "off", planted_pair["draft"])
    assert_laid_out(fast_engine, layers, nn.Linear, TransposedLinear)
    assert "stored transposed" in fast_engine.target.fast_path
    assert "stored transposed" in fast_engine.drafter.net.fast_path
    assert layers(dense_engine.target.model, TransposedLinear) == []
    assert dense_engine.drafter.net.fast_path == "eager"
    fast, plain = assert_same_speculation(fast_engine, dense_engine)
    assert fast.stats.draft_fast_path == fast_engine.drafter.net.fast_path and plain.stats.draft_fast_path is None


def test_not_transposed_in_bfloat16(planted_pair):
    bf16 = engine(planted_pair["target"], "auto", dtype="bfloat16")
    assert layers(bf16.target.model, TransposedLinear) == [] and not bf16.target.transposed
    assert "no float32 nn.Linear layers to transpose" in bf16.target.fast_path


def test_a_layer_that_disagrees_keeps_every_layer_as_loaded(planted_pair, monkeypatch):
    """A layer with more inputs than outputs (here the first k_proj, grouped-query attention)
    disagrees after q_proj was transposed: that goes back to nn.Linear with the weights it was
    loaded with, as does every other layer."""
    call = TransposedLinear.__call__
    monkeypatch.setattr(TransposedLinear, "__call__", lambda self, x: call(self, x) * (
        1.01 if self.weight_t.shape[0] > self.weight_t.shape[1] else 1.0))
    eng, off = engine(planted_pair["target"], "auto"), engine(planted_pair["target"], "off")
    assert "linear weights as loaded (" in eng.target.fast_path and "off the dense one" in eng.target.fast_path
    assert "layers.0.module.self_attn.k_proj:" in eng.target.fast_path
    assert layers(eng.target.model, TransposedLinear) == [] and layers(eng.target.model, nn.Linear)
    assert not eng.target.transposed
    for got, want in zip(layers(eng.target.model, nn.Linear), layers(off.target.model, nn.Linear)):
        assert mx.array_equal(got.weight, want.weight).item() and got.weight.shape == want.weight.shape


def test_transposing_measured_no_faster_keeps_the_layers_as_loaded(planted_pair, monkeypatch):
    monkeypatch.setattr(layout, "measured_speedup", lambda pairs: 0.98)
    eng = engine(planted_pair["target"], "auto", planted_pair["draft"])
    assert "measured no faster than the layout as loaded on this CPU (0.98x)" in eng.target.fast_path
    assert layers(eng.target.model, TransposedLinear) == [] and not eng.target.transposed
    assert "transposed" not in eng.drafter.net.fast_path
    on = engine(planted_pair["target"], "on")  # 'on' does not ask the clock
    assert on.target.transposed and layers(on.target.model, TransposedLinear)


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_products_equal_the_dense_ones(bias):
    holder = nn.Sequential(nn.Linear(96, 200, bias=bias))
    dense = holder.layers[0]
    assert transpose_linears(holder) == (1, None)
    layer = holder.layers[0]
    assert isinstance(layer, TransposedLinear)
    assert mx.array_equal(layer.weight, dense.weight).item()  # model code reading .weight sees [out, in]
    for rows in (1, 3, 8, 17):
        x = mx.random.normal((2, rows, 96), key=mx.random.key(rows))
        np.testing.assert_allclose(np.array(layer(x)), np.array(dense(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_transposed_expert_products_equal_mlx_lms(bias):
    """mlx-lm's mixture-of-experts layers (SwitchGLU's three SwitchLinear) stored [experts, in,
    out]: the same outputs for a step, a block and a prompt (SwitchGLU sorts the tokens by expert
    from 64 (token, expert) pairs on, so both ``gather_mm`` paths run), and, swapped back, the
    weights as loaded."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

    from speculant.backends.mlx.layout import TransposedSwitchLinear

    holder = nn.Sequential(nn.Linear(48, 48), SwitchGLU(48, 80, num_experts=6, bias=bias))
    for name in ("gate_proj", "up_proj", "down_proj") if bias else ():  # mlx-lm starts them at zero
        layer = getattr(holder.layers[1], name)
        layer.bias = mx.random.normal(layer.bias.shape, key=mx.random.key(len(name)))
    loaded = SwitchGLU(48, 80, num_experts=6, bias=bias)
    loaded.update(holder.layers[1].parameters())
    assert transpose_linears(holder) == (4, None)
    glu = holder.layers[1]
    assert all(type(getattr(glu, name)) is TransposedSwitchLinear for name in ("gate_proj", "up_proj", "down_proj"))
    for rows in (1, 8, 40):
        x = mx.random.normal((1, rows, 48), key=mx.random.key(rows))
        indices = mx.random.randint(0, 6, (1, rows, 2), key=mx.random.key(rows + 1))
        np.testing.assert_allclose(np.array(glu(x, indices)), np.array(loaded(x, indices)), rtol=1e-5, atol=1e-5)
    back = glu.down_proj.to_linear()
    assert type(back) is SwitchLinear and mx.array_equal(back.weight, loaded.down_proj.weight).item()


def test_a_tied_head_reads_a_transposed_copy(tmp_path, torch_threads):
    from speculant.testing.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    fast, slow = engine(target, "auto"), engine(target, "off")
    assert isinstance(fast.target._inner.embed_tokens, TransposedTiedEmbedding)
    assert "and the tied head stored transposed" in fast.target.fast_path
    logits = []
    for e in (fast, slow):
        e.target.reset()
        e.target.prefill(PROMPT)
        logits.append(np.array(e.target.forward(e.backend.int_array([9, 10, 11])).logits))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True)
    assert fast.run(**kwargs).token_ids == slow.run(**kwargs).token_ids


def test_the_mtp_draft_is_transposed_with_its_target(tmp_path, torch_threads):
    from speculant.testing.tiny import build_tiny_target
    from speculant.testing.tiny_mtp import build_tiny_mtp

    target = build_tiny_target(tmp_path / "target", seed=0, planted=7.5)
    folder = build_tiny_mtp(target, seed=3, folder=tmp_path / "mtp")
    fast, slow = engine(target, "auto", folder, kind="mtp"), engine(target, "off", folder, kind="mtp")
    assert "stored transposed" in fast.drafter.net.fast_path and slow.drafter.net.fast_path == "eager"
    assert layers(fast.drafter.net.model, nn.Linear) == [] and layers(fast.drafter.net.model, TransposedLinear)
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=32, ignore_eos=True)
    a, b = fast.run(**kwargs), slow.run(**kwargs)
    assert a.token_ids == b.token_ids and a.stats.acceptance_lengths == b.stats.acceptance_lengths
