"""The MLX backend's pieces: device/dtype resolution, hidden-state capture (layer ids and final
hidden, matching PyTorch), per-instance taps, cache rollback, embedding and head, memory stats,
and several drafters with different layer ids sharing one target."""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.core.config import BackendConfig, EngineConfig
from speculant.core.types import Capture

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def backend(kind="mlx", dtype="float32"):
    from speculant.plugins.manager import get_registry

    return get_registry().backends[kind](BackendConfig(kind=kind, device="cpu", dtype=dtype))


def load(kind, path, dtype="float32"):
    from speculant.core.validator import read_target_info

    b = backend(kind, dtype)
    return b, b.load_target(str(path), read_target_info(path))


@pytest.fixture(scope="module")
def targets(planted_pair):
    return {kind: load(kind, planted_pair["target"])[1] for kind in ("torch", "mlx")}


def host(x):
    return np.asarray(x.float().numpy() if hasattr(x, "detach") else np.array(x.astype(mx.float32)))


def test_device_and_dtype_resolution():
    from speculant.backends.mlx.backend import MLXBackend, resolve_device, resolve_dtype

    assert MLXBackend.availability_problem() is None
    auto = MLXBackend(BackendConfig(kind="mlx"))
    if not mx.metal.is_available():
        assert auto.device == "cpu" and auto.dtype == mx.float32
        with pytest.raises(RuntimeError, match="Metal is not available"):
            resolve_device("gpu")
    assert resolve_dtype("auto", "gpu") == mx.bfloat16
    assert resolve_dtype("float16", "cpu") == mx.float16
    with pytest.raises(RuntimeError, match="not an MLX device"):
        resolve_device("cuda")


def test_availability_problem_names_the_missing_package(monkeypatch):
    import importlib.util

    from speculant.backends.mlx.backend import MLXBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlx_lm" else real(name, *a))
    problem = MLXBackend.availability_problem()
    assert "mlx_lm" in problem and "pip install" in problem


@pytest.mark.parametrize("capture", [Capture((1,)), Capture((0, 2, 3)), Capture((2, 1), "pre_norm"),
                                     Capture((), "post_norm"), Capture((3,), "pre_norm")],
                         ids=["one", "three", "reordered_pre", "post_norm_only", "last_layer"])
def test_capture_matches_torch(targets, capture):
    outs = {}
    for kind, target in targets.items():
        target.reset()
        pre = target.prefill(PROMPT, capture)
        step = target.forward(target.backend.int_array([12, 13, 14]), capture)
        outs[kind] = (pre, step)
    for i in (0, 1):
        got, want = outs["mlx"][i], outs["torch"][i]
        np.testing.assert_allclose(host(got.logits), host(want.logits), atol=2e-4, rtol=1e-4)
        for field in ("features", "final_hidden"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape
                np.testing.assert_allclose(host(a), host(b), atol=2e-4, rtol=1e-4)
    prefill = outs["mlx"][0]
    assert prefill.logits.shape[0] == 1  # last row only
    for rows in (prefill.features, prefill.final_hidden):
        assert rows is None or rows.shape[0] == len(PROMPT)


def test_prefill_in_chunks_equals_one_pass(targets, monkeypatch):
    from speculant.backends.mlx import target as target_module

    mlx_target = targets["mlx"]
    mlx_target.reset()
    whole = mlx_target.prefill(PROMPT, Capture((1, 2)))
    monkeypatch.setattr(target_module, "PREFILL_STEP", 2)
    mlx_target.reset()
    chunked = mlx_target.prefill(PROMPT, Capture((1, 2)))
    assert mlx_target.cache_length == len(PROMPT)
    np.testing.assert_allclose(host(chunked.features), host(whole.features), atol=1e-5)
    np.testing.assert_allclose(host(chunked.logits), host(whole.logits), atol=1e-5)


def test_crop_rolls_the_cache_back(targets):
    t = targets["mlx"]
    t.reset()
    t.prefill([1, 2, 3])
    t.forward(t.backend.int_array([4, 5, 6]))
    assert t.cache_length == 6
    t.crop(4)
    assert t.cache_length == 4
    after_rollback = t.forward(t.backend.int_array([7])).logits
    t.reset()
    fresh = t.prefill([1, 2, 3, 4, 7]).logits
    np.testing.assert_allclose(host(after_rollback), host(fresh), atol=1e-5)
    t.crop(10)  # cropping beyond the length is a no-op
    assert t.cache_length == 5


def test_embed_and_head_match_torch(targets):
    ids = [0, 5, 160, 300]
    emb = {k: t.embed(t.backend.int_array(ids)) for k, t in targets.items()}
    np.testing.assert_allclose(host(emb["mlx"]), host(emb["torch"]), atol=1e-6)
    hidden = np.random.default_rng(0).standard_normal((2, emb["mlx"].shape[-1])).astype(np.float32)
    import torch

    heads = {"mlx": targets["mlx"].lm_head(mx.array(hidden)), "torch": targets["torch"].lm_head(torch.from_numpy(hidden))}
    np.testing.assert_allclose(host(heads["mlx"]), host(heads["torch"]), atol=1e-4)


def test_tied_embeddings_use_the_embedding_as_head(tmp_path, torch_threads):
    from speculant.testing.tiny import build_tiny_target

    path = build_tiny_target(tmp_path / "tied", seed=2, tie_word_embeddings=True)
    _, t = load("mlx", path)
    hidden = mx.array(np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32))
    weight = t.model.model.embed_tokens.weight
    np.testing.assert_allclose(host(t.lm_head(hidden)), host(hidden @ weight.T), atol=1e-5)
    plain = speculant.load_engine({"backend": {"kind": "mlx", "dtype": "float32"}, "target": {"path": str(path)}})
    assert len(plain.run(prompt_ids=[3, 4], max_new_tokens=5, ignore_eos=True).token_ids) == 5


def test_taps_are_per_instance_and_keep_mlx_lm_unchanged(targets, planted_pair):
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3
    from mlx_lm.utils import load_model

    from speculant.backends.mlx.target import Tap

    tapped = targets["mlx"].model
    assert all(isinstance(layer, Tap) for layer in tapped.model.layers)
    assert isinstance(tapped.model.norm, Tap)
    fresh, _ = load_model(planted_pair["target"])
    assert all(type(layer) is qwen3.TransformerBlock for layer in fresh.model.layers)
    assert "Tap" not in qwen3.TransformerBlock.__call__.__qualname__
    count = lambda m: sum(v.size for _, v in tree_flatten(m.parameters()))  # noqa: E731
    assert count(tapped) == count(fresh)


def test_two_drafters_with_different_layers_share_one_target(planted_pair, tmp_path):
    from speculant.core.engine import Engine
    from speculant.api import validate
    from speculant.plugins.manager import get_registry
    from speculant.testing.tiny import build_tiny_dflash
    from speculant.verifiers.greedy import GreedyVerifier

    other = build_tiny_dflash(tmp_path / "other", planted_pair["target"], seed=7, block_size=8, target_layer_ids=[0, 3])
    registry = get_registry()
    b, target = load("mlx", planted_pair["target"])
    results = []
    for draft in (planted_pair["draft"], other, planted_pair["draft"]):
        config = EngineConfig.model_validate({"backend": {"kind": "mlx", "dtype": "float32"},
                                              "target": {"path": str(planted_pair["target"])},
                                              "drafter": {"kind": "dflash", "path": str(draft), "block_size": 8}})
        report = validate(config, registry)
        assert report.ok, report.errors
        drafter = registry.drafters["dflash"].load(config.drafter, report.drafter, b, target)
        results.append(Engine(config, b, target, GreedyVerifier(), drafter, report).run(
            prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True))
    plain = Engine(config, b, target, GreedyVerifier()).run(prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True)
    assert all(r.token_ids == plain.token_ids for r in results)
    assert results[0].stats.acceptance_lengths == results[2].stats.acceptance_lengths


def test_bfloat16_target_and_peak_memory(planted_pair):
    b, t = load("mlx", planted_pair["target"], dtype="bfloat16")
    assert t.model.model.embed_tokens.weight.dtype == mx.bfloat16
    b.reset_peak_memory()
    out = t.prefill(PROMPT, Capture((1,)))
    b.synchronize()
    assert out.logits.dtype == mx.bfloat16 and out.features.dtype == mx.bfloat16
    assert b.peak_memory_bytes() > 0
    e = speculant.load_engine({"backend": {"kind": "mlx", "dtype": "bfloat16"}, "target": {"path": str(planted_pair["target"])},
                                      "drafter": {"kind": "dflash", "path": str(planted_pair["draft"])}})
    plain = speculant.load_engine({"backend": {"kind": "mlx", "dtype": "bfloat16"}, "target": {"path": str(planted_pair["target"])}})
    kwargs = dict(prompt_ids=[5, 6, 7], max_new_tokens=24, ignore_eos=True)
    assert e.run(block_size=8, **kwargs).token_ids == plain.run(**kwargs).token_ids


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory, planted_pair, torch_threads):
    """A tiny Llama target saved by transformers (tokenizer borrowed from the planted target)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculant.testing.tiny import build_tiny_dflash

    root = tmp_path_factory.mktemp("llama")
    target = root / "target"
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(planted_pair["target"] / name, target / name)
    torch.manual_seed(4)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                         tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(str(target), safe_serialization=True)
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=8, target_layer_ids=[1, 2])
    return {"target": target, "draft": draft}


def test_llama_target_matches_torch_and_stays_lossless(llama_pair):
    from speculant.backends.mlx.target import Tap

    kw = dict(prompt_ids=[5, 6, 7, 8], max_new_tokens=24, ignore_eos=True)
    plain = {kind: speculant.load_engine({"backend": {"kind": kind, "device": "cpu", "dtype": "float32"},
                                                 "target": {"path": str(llama_pair["target"])}}) for kind in ("torch", "mlx")}
    assert plain["mlx"].target.info.model_type == "llama"
    assert isinstance(plain["mlx"].target.model.model.layers[0], Tap)
    tokens = plain["mlx"].run(**kw).token_ids
    assert tokens == plain["torch"].run(**kw).token_ids
    captured = {}
    for kind, e in plain.items():
        e.target.reset()
        captured[kind] = e.target.prefill(PROMPT, Capture((1, 2), "post_norm"))
    for field in ("features", "final_hidden"):
        np.testing.assert_allclose(host(getattr(captured["mlx"], field)), host(getattr(captured["torch"], field)), atol=2e-4)
    spec = speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32"},
                                         "target": {"path": str(llama_pair["target"])},
                                         "drafter": {"kind": "dflash", "path": str(llama_pair["draft"])}})
    for block in (3, 8):
        assert spec.run(block_size=block, **kw).token_ids == tokens


def test_sliding_draft_layers_keep_window_minus_one_context_rows(planted_pair):
    """The eager draft step's context cache (the compiled step's ring: test_static_cache_mlx.py)."""
    e = speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": "off"},
                                      "target": {"path": str(planted_pair["target"])},
                                      "drafter": {"kind": "dflash", "path": str(planted_pair["draft_swa"])}})
    e.run(prompt_ids=list(range(20, 52)), max_new_tokens=20, block_size=4, ignore_eos=True)
    cache = e.drafter.net.cache
    assert cache.windows == [8, 8]
    assert all(cache.length(i) == 7 and cache.view(i)[0].shape[2] == 7 for i in range(2))
    assert e.drafter.max_context == 7  # all layers slide: older feature rows are never projected


def test_mlx_takes_dflash_keys_only_from_dflash_config(planted_pair, tmp_path):
    """The reference MLX loader's stricter rule: mask_token_id and target_layer_ids at the top
    level of config.json serve PyTorch (transformers reads them there) but not MLX, whose
    validator names the dflash_config keys to add, before any weights load."""
    import json
    import shutil

    from speculant.api import validate

    draft = tmp_path / "draft"
    shutil.copytree(planted_pair["draft"], draft)
    raw = json.loads((draft / "config.json").read_text())
    raw.update(raw.pop("dflash_config"))  # block_size may sit at the top level under both rules
    (draft / "config.json").write_text(json.dumps(raw))

    def errors(kind):
        report = validate({"backend": {"kind": kind, "device": "cpu", "dtype": "float32"},
                           "target": {"path": str(planted_pair["target"])},
                           "drafter": {"kind": "dflash", "path": str(draft)}})
        return [p.field for p in report.errors]

    assert errors("torch") == []
    assert errors("mlx") == ["drafter.path (dflash_config.mask_token_id)", "drafter.path (dflash_config.target_layer_ids)"]
