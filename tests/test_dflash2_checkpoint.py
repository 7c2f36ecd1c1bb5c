"""DFlash2 checkpoint contract: the published layout loads (both codebook spellings), and every
missing or mis-shaped tensor and every missing or wrong config key is refused by the validator
before any weight loads, with a problem naming it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import speculant
from speculant.drafters.dflash2.checkpoint import CODEBOOKS

DFLASH_KEYS = ["block_size", "mask_token_id", "target_layer_ids", "conv_kernel_size", "conv_group_size",
               "selector_rank", "selector_top_k"]
TOP_LEVEL_KEYS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "num_target_layers", "vocab_size", "is_causal"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny import build_tiny_target
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2

    root = tmp_path_factory.mktemp("dflash2_ckpt")
    target = build_tiny_target(root / "target", seed=0)
    draft = build_tiny_dflash2(root / "draft", target, seed=3, num_layers=1, block_size=4, sliding_window=8)
    suffixed = build_tiny_dflash2(root / "draft_weight", target, seed=3, num_layers=1, block_size=4,
                                  sliding_window=8, codebook_suffix=".weight")
    return {"root": root, "target": target, "draft": draft, "draft_weight": suffixed}


def config(target, draft, **drafter):
    return {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
            "drafter": {"kind": "dflash2", "path": str(draft), **drafter}}


def errors(target, draft) -> list[str]:
    return [str(p) for p in speculant.validate(config(target, draft)).errors]


def variant(pair, name, edit_tensors=None, edit_config=None):
    """A copy of the tiny draft with its tensors and/or config edited."""
    from safetensors.numpy import load_file, save_file

    out = pair["root"] / name
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(pair["draft"], out)
    if edit_tensors:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def tensor_names(pair) -> list[str]:
    from safetensors.numpy import load_file

    return sorted(load_file(str(pair["draft"] / "model.safetensors")))


def test_published_layout_validates_and_counts(pair):
    assert errors(pair["target"], pair["draft"]) == []
    names = tensor_names(pair)
    assert len(names) == 6 + 15  # 6 top-level + 15 per layer, as in the published 81-tensor file
    assert all(name in names for name in CODEBOOKS)  # no .weight suffix on disk
    report = speculant.validate(config(pair["target"], pair["draft"]))
    info = report.drafter
    assert info.kind == "dflash2" and info.can_sample and info.trained_block_size == 4
    assert [k.value for k in info.proposal_kinds] == ["one_hot", "sparse"]


def test_both_codebook_spellings_load_and_agree(pair):
    assert errors(pair["target"], pair["draft_weight"]) == []
    outputs = []
    for key in ("draft", "draft_weight"):
        engine = speculant.load_engine(config(pair["target"], pair[key]))
        selector = engine.drafter.model.candidate_selector
        assert float(selector.successor_codebook.abs().sum()) > 0  # really loaded, not left at init
        outputs.append(engine.run(prompt_ids=[5, 6, 7], max_new_tokens=12, ignore_eos=True).token_ids)
    assert outputs[0] == outputs[1]


def test_both_spellings_in_one_file_is_refused(pair):
    def add_suffixed(t):
        t[CODEBOOKS[0] + ".weight"] = t[CODEBOOKS[0]].copy()

    errs = errors(pair["target"], variant(pair, "both_spellings", add_suffixed))
    assert any(CODEBOOKS[0] in e and "both" in e for e in errs), errs


def test_every_missing_tensor_is_named(pair):
    for name in tensor_names(pair):
        errs = errors(pair["target"], variant(pair, "missing", lambda t, n=name: t.pop(n)))
        assert any(f"missing tensor {name}" in e for e in errs), (name, errs)


def test_every_misshaped_tensor_is_named(pair):
    def grow(t, n):
        t[n] = np.concatenate([t[n], t[n][:1]], axis=0)

    for name in tensor_names(pair):
        errs = errors(pair["target"], variant(pair, "misshaped", lambda t, n=name: grow(t, n)))
        assert any(f"tensor {name} has shape" in e for e in errs), (name, errs)


@pytest.mark.parametrize("key", DFLASH_KEYS)
def test_missing_dflash_config_key_is_named(pair, key):
    errs = errors(pair["target"], variant(pair, "no_" + key, edit_config=lambda c: c["dflash_config"].pop(key)))
    assert any(key in e for e in errs), errs


@pytest.mark.parametrize("key", TOP_LEVEL_KEYS)
def test_missing_top_level_key_is_named(pair, key):
    errs = errors(pair["target"], variant(pair, "no_" + key, edit_config=lambda c: c.pop(key)))
    assert any(key in e for e in errs), errs


@pytest.mark.parametrize("value", [True, None, "false"])
def test_is_causal_must_be_false(pair, value):
    errs = errors(pair["target"], variant(pair, "causal", edit_config=lambda c: c.update(is_causal=value)))
    assert any("is_causal" in e for e in errs), errs


def test_hidden_size_and_vocab_must_match_the_target(pair):
    errs = errors(pair["target"], variant(pair, "hidden", edit_config=lambda c: c.update(hidden_size=128)))
    assert any("hidden_size 128 != target hidden_size" in e for e in errs), errs
    errs = errors(pair["target"], variant(pair, "vocab", edit_config=lambda c: c.update(vocab_size=321)))
    assert any("vocab_size 321 != target vocab_size" in e for e in errs), errs


@pytest.mark.parametrize("name", ["lm_head.weight", "embed_tokens.weight"])
def test_draft_head_or_embedding_is_refused(pair, name):
    def add(t):
        t[name] = np.zeros((320, 64), np.float32)

    errs = errors(pair["target"], variant(pair, "own_" + name.split(".")[0], add))
    assert any(name in e for e in errs), errs


def test_dflash_v1_checkpoint_points_at_the_right_kind(pair):
    from speculant.testing.tiny import build_tiny_dflash

    v1 = build_tiny_dflash(pair["root"] / "v1", pair["target"], seed=3, num_layers=1, block_size=4)
    errs = errors(pair["target"], v1)
    assert any("DFlashDraftModel" in e and "dflash'" in e for e in errs), errs


def test_runtime_block_is_bounded_by_the_trained_block(pair):
    bad = speculant.validate(config(pair["target"], pair["draft"], block_size=5)).errors
    assert any("drafter.block_size" in p.field for p in bad)
    assert speculant.validate(config(pair["target"], pair["draft"], block_size=2)).ok


def test_loader_refuses_both_spellings_even_without_validation(pair):
    from speculant.core.errors import CheckpointError

    def add_suffixed(t):
        t[CODEBOOKS[1] + ".weight"] = t[CODEBOOKS[1]].copy()

    bad = variant(pair, "both_spellings_load", add_suffixed)
    engine = speculant.load_engine(config(pair["target"], pair["draft"]))
    from speculant.plugins.manager import get_registry

    dflash2 = get_registry().drafters["dflash2"]
    cfg = speculant.EngineConfig.load(config(pair["target"], bad)).drafter
    with pytest.raises(CheckpointError, match="both"):
        dflash2.load(cfg, engine.drafter.info, engine.backend, engine.target)
