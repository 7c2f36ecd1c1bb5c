"""MTP checkpoint formats: both published layouts load; the validator names every problem
from config.json and safetensors headers alone."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speculant.api import validate
from speculant.testing.tiny_mtp import build_tiny_mtp, canonical_mtp, copy_target, mtp_tensors, write_mtp

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def base(tmp_path_factory, torch_threads):
    from speculant.testing.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("mtp_fmt") / "base", seed=0)


def config(target, path=None, **options):
    drafter = {"kind": "mtp", "options": options}
    if path is not None:
        drafter["path"] = str(path)
    return {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}, "drafter": drafter}


def errors(report):
    return [str(p) for p in report.errors]


@pytest.mark.parametrize("layout", ["qwen", "deepseek"])
@pytest.mark.parametrize("where", ["target_folder", "separate_folder"])
def test_both_layouts_validate_and_load(base, tmp_path, layout, where):
    import speculant

    target = copy_target(base, tmp_path / "target")
    folder = None if where == "target_folder" else tmp_path / "mtp"
    build_tiny_mtp(target, layout=layout, folder=folder, num_layers=2, seed=1)
    report = validate(config(target, folder))
    assert report.ok, errors(report)
    info = report.drafter
    assert info.kind == "mtp" and info.trained_block_size == 3
    assert info.extra["config"].layout == layout and info.extra["config"].num_layers == 2
    assert info.final_hidden == "post_norm"
    assert info.extra["config"].recycle_hidden == ("post_norm" if layout == "qwen" else "pre_norm")
    engine = speculant.load_engine(config(target, folder))
    assert engine.drafter.cfg.norm_offset == (1.0 if layout == "qwen" else 0.0)
    result = engine.run(prompt_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True)
    assert len(result.token_ids) == 6


def test_drafter_path_equal_to_target_path_means_target_folder(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    build_tiny_mtp(target, layout="qwen")
    assert validate(config(target, target)).ok


def test_count_under_text_config(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    tensors = mtp_tensors(canonical_mtp(target, 1, seed=2), "qwen")
    folder = write_mtp(target, tensors, "qwen", 1, folder=tmp_path / "mtp", text_config=True)
    assert "mtp_num_hidden_layers" in json.loads((folder / "config.json").read_text())["text_config"]
    report = validate(config(target, folder))
    assert report.ok, errors(report)
    assert report.drafter.extra["config"].num_layers == 1


def test_loader_reads_only_mtp_tensors(base, tmp_path):
    from speculant.drafters.mtp.torch import read_mtp_tensors

    target = copy_target(base, tmp_path / "target")
    build_tiny_mtp(target, layout="deepseek", num_layers=1)
    cfg = validate(config(target)).drafter.extra["config"]
    state = read_mtp_tensors(cfg)
    assert "proj.0.weight" in state and "blocks.0.mlp.up_proj.weight" in state
    assert not any("embed" in k or "lm_head" in k or "head.weight" in k for k in state)


# -- validator problems ----------------------------------------------------------------------
@pytest.mark.parametrize("layout,name", [
    ("qwen", "mtp.fc.weight"),
    ("qwen", "mtp.layers.0.self_attn.k_norm.weight"),
    ("deepseek", "model.layers.4.eh_proj.weight"),
    ("deepseek", "model.layers.4.shared_head.norm.weight"),
])
def test_missing_tensor_is_named(base, tmp_path, layout, name):
    target = copy_target(base, tmp_path / "target")
    tensors = mtp_tensors(canonical_mtp(target, 1, seed=2), layout, first_layer=4)
    del tensors[name]
    folder = write_mtp(target, tensors, layout, 1, folder=tmp_path / "mtp")
    report = validate(config(target, folder))
    assert not report.ok
    assert any(f"missing tensor {name}" in e and e.startswith("drafter.path") for e in errors(report)), errors(report)


@pytest.mark.parametrize("layout,extra", [
    ("qwen", "mtp.layers.0.self_attn.extra_scale"),
    ("qwen", "mtp.layers.1.input_layernorm.weight"),  # a second layer the config does not declare
    ("deepseek", "model.layers.5.enorm.weight"),
])
def test_unknown_extra_mtp_tensor_is_named(base, tmp_path, layout, extra):
    target = copy_target(base, tmp_path / "target")
    tensors = mtp_tensors(canonical_mtp(target, 1, seed=2), layout, first_layer=4)
    tensors[extra] = np.zeros(64, dtype=np.float32)
    write_mtp(target, tensors, layout, 1)  # in the target folder: the target's own tensors are not MTP's
    report = validate(config(target))
    assert [e for e in errors(report)] == [f"target.path: unexpected tensor {extra} (fix: use a checkpoint saved in the published {layout} MTP layout)"]


@pytest.mark.parametrize("layout,key", [("qwen", "mtp_num_hidden_layers"), ("deepseek", "num_nextn_predict_layers")])
@pytest.mark.parametrize("count", [None, 0])
def test_absent_or_zero_layer_count_names_the_field(base, tmp_path, layout, key, count):
    target = copy_target(base, tmp_path / "target")
    tensors = mtp_tensors(canonical_mtp(target, 1, seed=2), layout, first_layer=4)
    folder = write_mtp(target, tensors, layout, 1, folder=tmp_path / "mtp", count=count)
    report = validate(config(target, folder))
    assert not report.ok
    assert any(p.field == f"drafter.path ({key})" for p in report.errors), errors(report)
    assert any(key in p.fix for p in report.errors)


def test_target_without_mtp_weights(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    report = validate(config(target))
    assert any("holds no MTP weights" in e for e in errors(report)), errors(report)


def test_shape_mismatch_is_named(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    tensors = mtp_tensors(canonical_mtp(target, 1, seed=2), "qwen")
    tensors["mtp.fc.weight"] = tensors["mtp.fc.weight"][:, :64].copy()  # [H, H] instead of [H, 2H]
    write_mtp(target, tensors, "qwen", 1)
    assert any("mtp.fc.weight has shape [64, 64], expected [64, 128]" in e for e in errors(validate(config(target))))


def test_dedicated_embeddings_reported_and_moe_mla_need_their_tensors(base, tmp_path):
    """MoE and MLA blocks load now (tests/test_mtp_moe_mla.py); a dense checkpoint whose config
    declares them gets every missing MLA tensor named, and stray expert tensors too."""
    tensors = mtp_tensors(canonical_mtp(base, 1, seed=2), "deepseek", first_layer=4)
    tensors["model.layers.4.mlp.experts.0.up_proj.weight"] = np.zeros((8, 64), dtype=np.float32)

    def problems(name, **updates):
        target = copy_target(base, tmp_path / name)
        write_mtp(target, tensors, "deepseek", 1, config_updates=updates)
        return errors(validate(config(target)))

    assert any("(mtp_use_dedicated_embeddings)" in e for e in problems("dedicated", mtp_use_dedicated_embeddings=True))
    found = problems("stray")
    assert any("unexpected tensor model.layers.4.mlp.experts.0.up_proj.weight" in e for e in found), found
    found = problems("mla", kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    assert any("missing tensor model.layers.4.self_attn.kv_a_proj_with_mqa.weight (expected shape [24, 64])" in e for e in found), found
    found = problems("mla_incomplete", kv_lora_rank=16)
    assert any("(qk_nope_head_dim)" in e for e in found), found


def test_options_are_validated(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    build_tiny_mtp(target, layout="qwen")
    report = validate(config(target, hidden_taps="post_norm"))
    assert any(p.field == "drafter.options" and "hidden_taps" in p.message for p in report.errors)
    report = validate(config(target, hidden_tap="middle"))
    assert any(p.field == "drafter.options" and "hidden_tap" in p.message for p in report.errors)


def test_options_override_family_defaults(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    build_tiny_mtp(target, layout="deepseek")
    report = validate(config(target, hidden_tap="pre_norm", recycle_hidden="post_norm", sample_drafts=True))
    assert report.ok, errors(report)
    assert report.drafter.final_hidden == "pre_norm" and report.drafter.capture.final_hidden == "pre_norm"
    assert report.drafter.extra["config"].recycle_hidden == "post_norm"
    assert report.drafter.can_sample


def test_declared_layout_that_does_not_match(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    build_tiny_mtp(target, layout="qwen")
    problems = errors(validate(config(target, layout="deepseek")))
    assert any("num_nextn_predict_layers" in e for e in problems), problems


# -- norm shift detection (headers and config only) ------------------------------------------
def test_mlx_saved_folder_is_taken_as_pre_shifted(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    folder = build_tiny_mtp(target, layout="qwen", folder=tmp_path / "mtp", shifted=True)
    report = validate(config(target, folder))
    assert report.ok and report.drafter.extra["config"].norm_offset == 0.0
    assert any("pre-shifted" in p.message for p in report.warnings)
    declared = validate(config(target, folder, norm_shifted=False))
    assert declared.drafter.extra["config"].norm_offset == 1.0 and not declared.warnings


def test_raw_folder_gets_the_plus_one(base, tmp_path):
    target = copy_target(base, tmp_path / "target")
    folder = build_tiny_mtp(target, layout="qwen", folder=tmp_path / "mtp", shifted=False)
    assert validate(config(target, folder)).drafter.extra["config"].norm_offset == 1.0
    assert validate(config(target, folder, norm_shifted=True)).drafter.extra["config"].norm_offset == 0.0
