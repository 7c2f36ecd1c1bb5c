"""In-memory draft quantization (``w4a16:gs64`` specs) and quantized targets.

Quantized drafts stay lossless on MLX (bits 4 and 8, group sizes 32/64/128) and on PyTorch
(torchao); codebooks and conv kernels stay in float unless asked; the validator rejects bad
specs with the allowed values, names layer widths a group size does not divide, says where a
backend cannot quantize, and warns (only warns) about wide blocks with quantized MLX models.
"""

from __future__ import annotations

import pytest

import speculant
from speculant.api import validate
from speculant.drafters import quantization

PROMPTS = ([5], [5, 6, 7], list(range(20, 52)))


@pytest.fixture(scope="session")
def pair128(tmp_path_factory, torch_threads):
    """A target and draft whose every layer width is a multiple of 128 (all group sizes fit);
    planted weakly, so drafts are accepted sometimes and rejected sometimes."""
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    root = tmp_path_factory.mktemp("pair128")
    target = build_tiny_target(root / "target", seed=0, planted=1.0, hidden_size=128)
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=16)
    return {"target": target, "draft": draft, "root": root}


def config(backend, target, draft=None, quant=None, block=None, dtype="float32"):
    data = {"backend": {"kind": backend, "device": "cpu", "dtype": dtype}, "target": {"path": str(target)}}
    if draft is not None:
        data["drafter"] = {"kind": "dflash", "path": str(draft), "quantization": quant, "block_size": block}
    return data


def outputs(engine, **kw):
    return [engine.run(prompt_ids=p, max_new_tokens=32, ignore_eos=True, **kw) for p in PROMPTS]


# -- MLX -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mlx_plain(pair128):
    pytest.importorskip("mlx_lm")
    return [r.token_ids for r in outputs(speculant.load_engine(config("mlx", pair128["target"])))]


@pytest.mark.mlx
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_draft_is_lossless_on_mlx(pair128, mlx_plain, bits, group_size):
    import mlx.nn as nn

    spec = f"w{bits}a32:gs{group_size}"
    engine = speculant.load_engine(config("mlx", pair128["target"], pair128["draft"], spec, block=5))
    quantized = [m for _, m in engine.drafter.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(quantized) == 1 + 7 * 2  # fc + 7 linears per layer
    assert {(m.bits, m.group_size) for m in quantized} == {(bits, group_size)}
    results = outputs(engine, block_size=5)
    assert [r.token_ids for r in results] == mlx_plain
    lengths = [a for r in results for a in r.stats.acceptance_lengths]
    assert max(lengths) > 1 and min(lengths) == 1  # both acceptance and rejection happened


@pytest.mark.mlx
def test_sixteen_bit_activations_on_mlx(pair128, mlx_plain):
    import mlx.core as mx

    engine = speculant.load_engine(config("mlx", pair128["target"], pair128["draft"], "w4a16:gs64", block=4))
    assert engine.drafter.net.dtype == mx.bfloat16
    assert engine.drafter.model.norm.weight.dtype == mx.bfloat16
    assert outputs(engine, block_size=4)[1].token_ids == mlx_plain[1]


@pytest.mark.mlx
def test_quantized_mlx_target_folder(pair128):
    """An mlx-community style folder (``mlx_lm.convert`` output, config.json ``quantization``)."""
    import mlx.nn as nn
    from mlx_lm import convert

    folder = pair128["root"] / "target_q4"
    if not folder.exists():
        convert(str(pair128["target"]), str(folder), quantize=True, q_group_size=64, q_bits=4)
    spec = speculant.load_engine(config("mlx", folder, pair128["draft"], block=4))
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in spec.target.model.named_modules())
    plain = speculant.load_engine(config("mlx", folder))
    kw = dict(prompt_ids=[5, 6, 7], max_new_tokens=32, ignore_eos=True)
    assert spec.run(block_size=4, **kw).token_ids == plain.run(**kw).token_ids
    wide = validate(config("mlx", folder, pair128["draft"]))  # trained block 16
    assert wide.ok and any("quantized target" in w.message for w in wide.warnings)


def test_default_exclusions_keep_codebooks_and_conv_kernels():
    mlx_nn = pytest.importorskip("mlx.nn")

    class Selector(mlx_nn.Module):
        def __init__(self):
            super().__init__()
            self.hidden_projection = mlx_nn.Linear(64, 64)
            self.predecessor_codebook = mlx_nn.Embedding(32, 64)

    class Conv(mlx_nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel_projection = mlx_nn.Linear(64, 16)

    class Toy(mlx_nn.Module):
        def __init__(self):
            super().__init__()
            self.candidate_selector = Selector()
            self.attention_conv = Conv()
            self.fc = mlx_nn.Linear(64, 64)

    toy = Toy()
    q = quantization.resolve("w4:gs64")
    assert quantization.quantize_mlx(toy, q) == ["candidate_selector.hidden_projection", "fc"]
    assert isinstance(toy.candidate_selector.predecessor_codebook, mlx_nn.Embedding)
    assert isinstance(toy.attention_conv.kernel_projection, mlx_nn.Linear)
    everything = Toy()
    done = quantization.quantize_mlx(everything, q, exclude=lambda path: False)
    assert "candidate_selector.predecessor_codebook" in done and "attention_conv.kernel_projection" in done


# -- PyTorch (torchao) -----------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["w8a32:gs64", "w4a32:gs32", "w4a16:gs128"])
def test_quantized_draft_is_lossless_on_torch(pair128, spec):
    pytest.importorskip("torchao")
    plain = [r.token_ids for r in outputs(speculant.load_engine(config("torch", pair128["target"])))[:2]]
    engine = speculant.load_engine(config("torch", pair128["target"], pair128["draft"], spec, block=5))
    weight = engine.drafter.model.layers[0].mlp.down_proj.weight
    assert "Intx" in type(weight).__name__  # torchao's quantized weight tensor
    assert [r.token_ids for r in outputs(engine, block_size=5)[:2]] == plain


# -- validator -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, field, allowed", [
    ("w3a16:gs64", "drafter.quantization.weight_bits", "2, 4, 8"),
    ("w4a8:gs64", "drafter.quantization.activation_bits", "16, 32"),
    ("w4a16:gs48", "drafter.quantization.group_size", "32, 64, 128"),
])
@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_invalid_specs_list_the_allowed_values(planted_pair, backend, spec, field, allowed):
    report = validate(config(backend, planted_pair["target"], planted_pair["draft"], spec))
    errors = [p for p in report.errors if p.field == field]
    assert errors and allowed in errors[0].fix


def test_unparsable_spec_is_an_error(planted_pair):
    report = validate(config("mlx", planted_pair["target"], planted_pair["draft"], "int4"))
    assert any(p.field == "drafter.quantization" and "w4a16:gs64" in p.fix for p in report.errors)


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_group_size_must_divide_every_quantized_width(planted_pair, backend):
    """The planted pair has hidden 64 and intermediate 192: 128 fits neither."""
    if backend == "torch":
        pytest.importorskip("torchao")
    report = validate(config(backend, planted_pair["target"], planted_pair["draft"], "w4a32:gs128"))
    [problem] = [p for p in report.errors if p.field == "drafter.quantization.group_size"]
    assert "does not divide" in problem.message and "fc (192)" in problem.message
    assert problem.fix.endswith("32, 64")
    assert validate(config(backend, planted_pair["target"], planted_pair["draft"], "w4a32:gs64")).ok


def test_application_refuses_a_group_size_that_does_not_divide():
    mlx_nn = pytest.importorskip("mlx.nn")
    class Holder(mlx_nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = mlx_nn.Linear(96, 32)

    with pytest.raises(ValueError, match=r"does not divide the input width of proj \(96\)"):
        quantization.quantize_mlx(Holder(), quantization.resolve("w4:gs64"))


def test_backend_support_is_reported(planted_pair, monkeypatch):
    from speculant.core.config import EngineConfig

    cfg = EngineConfig.model_validate(config("torch", planted_pair["target"], planted_pair["draft"], "w4a32:gs32"))
    real = quantization.importlib.util.find_spec
    monkeypatch.setattr(quantization.importlib.util, "find_spec", lambda n, *a: None if n == "torchao" else real(n, *a))
    [problem] = quantization.check_quantization(cfg, None, None)
    assert "torchao" in problem.message and "pip install" in problem.fix
    other = cfg.model_copy(update={"backend": cfg.backend.model_copy(update={"kind": "onnx"})})
    [problem] = quantization.check_quantization(other, None, None)
    assert "mlx and torch" in problem.message
    off = EngineConfig.model_validate(config("torch", planted_pair["target"], planted_pair["draft"], "off"))
    assert quantization.check_quantization(off, None, None) == []


@pytest.mark.parametrize("backend, quant, block, warned", [
    ("mlx", "w4a32:gs64", 8, True),
    ("mlx", "w4a32:gs64", 5, False),
    ("mlx", None, 16, False),
    ("torch", "w4a32:gs64", 16, False),
])
def test_wide_blocks_with_quantized_mlx_models_warn(planted_pair, backend, quant, block, warned):
    if backend == "torch" and quant:
        pytest.importorskip("torchao")
    report = validate(config(backend, planted_pair["target"], planted_pair["draft"], quant, block))
    assert report.ok
    warnings = [w for w in report.warnings if w.field == "drafter.block_size"]
    assert bool(warnings) == warned
    if warned:
        assert warnings[0].severity == "warning" and "grows with the verify width" in warnings[0].message


@pytest.mark.mlx
def test_sixteen_bit_activations_on_mlx_cpu_warn(planted_pair):
    mx = pytest.importorskip("mlx.core")
    if mx.metal.is_available():
        pytest.skip("the advice is for machines without Metal")
    report = validate(config("mlx", planted_pair["target"], planted_pair["draft"], "w4a16:gs64", 4))
    assert report.ok
    assert [w.field for w in report.warnings] == ["drafter.quantization.activation_bits"]
