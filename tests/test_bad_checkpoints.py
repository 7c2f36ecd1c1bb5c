"""Damaged checkpoints and tokenizers (issue 37): ``validate`` names the file before any weights
load and keeps reporting everything else, ``generate`` exits 2 with the same message, and the
strict loaders refuse what ``validate`` would have, for targets and drafts on both backends.

The models are tiny real checkpoints (speculant.testing) damaged on disk: a float tensor
relabelled with the integer dtype of the same width, a truncated tokenizer.json, an unknown
``model_type``, a 200,000-deep safetensors header, a header that is a JSON list.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from speculant.api import assemble, validate
from speculant.cli import main
from speculant.core.config import BackendConfig, EngineConfig
from speculant.core.errors import CheckpointError, ConfigError
from speculant.plugins.manager import get_registry

pytest.importorskip("torch")

FLOATS = "expected one of F32, F16, BF16"
UP = "layers.0.mlp.up_proj.weight"


@pytest.fixture(autouse=True)
def builtins_only(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")
    monkeypatch.delenv("SPECULANT_DEBUG", raising=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory, torch_threads):
    """A target with its DFlash, DFlash2 and MTP drafts, built once; each test damages a copy."""
    from speculant.testing.tiny import build_tiny_pair
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2
    from speculant.testing.tiny_mtp import build_tiny_mtp

    root = tmp_path_factory.mktemp("bad_checkpoints")
    target, _ = build_tiny_pair(root, seed=1, block_size=8)
    build_tiny_dflash2(root / "dflash2", target, seed=2)
    build_tiny_mtp(target, layout="qwen", folder=root / "mtp", seed=3)
    return root


@pytest.fixture
def models(built, tmp_path) -> dict[str, Path]:
    shutil.copytree(built, tmp_path / "models")
    root = tmp_path / "models"
    return {"target": root / "target", "dflash": root / "draft", "dflash2": root / "dflash2", "mtp": root / "mtp"}


def config(models, backend="torch", drafter=None) -> dict:
    data = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(models["target"])}}
    if drafter is not None:
        data["drafter"] = {"kind": drafter, "path": str(models[drafter])}
    return data


def needs(backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")


def rewrite_header(file: Path, edit) -> None:
    """Replace a safetensors file's JSON header (``edit`` gets the dict, returns a dict or raw
    bytes); the tensor data is kept byte for byte (offsets count from the end of the header)."""
    data = file.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    new = edit(json.loads(data[8:8 + size]))
    raw = new if isinstance(new, bytes) else json.dumps(new).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size:])


def relabel(file: Path, name: str, dtype: str) -> None:
    def edit(header):
        header[name]["dtype"] = dtype
        return header

    rewrite_header(file, edit)


def store_as_bfloat16(file: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file
    import torch

    weights = load_file(str(file))
    weights[name] = weights[name].to(torch.bfloat16)
    save_file(weights, str(file), metadata={"format": "pt"})


def cli(capsys, args: list[str]) -> tuple[int, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def write_config(tmp_path: Path, data: dict) -> str:
    file = tmp_path / "engine.json"
    file.write_text(json.dumps(data))
    return str(file)


def assert_reported(capsys, tmp_path, data: dict, *words: str) -> None:
    """``validate`` prints the words on one line and exits 1; ``generate`` exits 2 with them,
    without a traceback or a request to report a bug."""
    file = write_config(tmp_path, data)
    for command, expected in ((["validate", file], 1), (["generate", "--config", file, "hi"], 2)):
        code, text = cli(capsys, command)
        assert code == expected, text
        assert any(all(w in line for w in words) for line in text.splitlines()), text
        assert "please report" not in text and "Traceback" not in text and "plugin's authors" not in text, text


# -- Bad 3: a float tensor stored with an integer dtype ---------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("stored, relabelled", [("F32", "I32"), ("BF16", "I16")])
def test_target_float_tensor_relabelled_as_integer_is_refused(capsys, tmp_path, models, backend, stored, relabelled):
    needs(backend)
    weights, name = models["target"] / "model.safetensors", "model." + UP
    if stored == "BF16":
        store_as_bfloat16(weights, name)
        assert validate(config(models, backend)).ok  # a bfloat16 tensor is fine
    relabel(weights, name, relabelled)
    report = validate(config(models, backend))
    assert [p.field for p in report.errors] == ["target.path"], report.errors
    assert all(w in report.errors[0].message for w in ("model.safetensors", name, f"stored as {relabelled}", FLOATS))
    assert_reported(capsys, tmp_path, config(models, backend), name, relabelled, FLOATS)
    loaded = get_registry().backends[backend](BackendConfig(kind=backend, device="cpu", dtype="float32"))
    with pytest.raises(CheckpointError, match=rf"{name} is stored as {relabelled}"):
        loaded.load_target(str(models["target"]), report.target)


DRAFT_TENSOR = {"dflash": UP, "dflash2": UP, "mtp": "mtp." + UP}


@pytest.mark.parametrize("kind, backend", [("dflash", "torch"), ("dflash", "mlx"), ("dflash2", "torch"),
                                           ("dflash2", "mlx"), ("mtp", "torch"), ("mtp", "mlx")])
def test_draft_integer_tensor_is_refused_by_validate_and_the_loader(tmp_path, models, kind, backend):
    needs(backend)
    data = config(models, backend, kind)
    clean = validate(data)
    assert clean.ok, clean.errors
    relabel(models[kind] / "model.safetensors", DRAFT_TENSOR[kind], "I32")
    report = validate(data)
    assert [p.field for p in report.errors] == ["drafter.path"], report.errors
    assert all(w in report.errors[0].message for w in (str(models[kind]), "model.safetensors", DRAFT_TENSOR[kind],
                                                      "stored as I32", FLOATS))
    # the loader itself refuses it (the file changed after the check, or a caller skipped it)
    with pytest.raises(CheckpointError, match=rf"{DRAFT_TENSOR[kind]} is stored as I32"):
        assemble(EngineConfig.load(data), clean, get_registry())


def _quantized_folder(tmp_path: Path, quantized: bool) -> Path:
    """Headers of quantized modules as mlx-lm, GPTQ and bitsandbytes write them, beside float norms."""
    from safetensors.numpy import save_file

    folder = tmp_path / ("quantized" if quantized else "plain")
    folder.mkdir()
    config = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128}
    if quantized:
        config["quantization"] = {"group_size": 64, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": np.zeros((64, 8), np.uint32), "model.embed_tokens.scales": np.zeros((64, 1), np.float16),
        "model.embed_tokens.biases": np.zeros((64, 1), np.float16), "model.norm.weight": np.ones(64, np.float32),
        p + "input_layernorm.weight": np.ones(64, np.float32),
        p + "self_attn.q_proj.weight": np.zeros((64, 8), np.uint32), p + "self_attn.q_proj.scales": np.zeros((64, 1), np.float16),
        p + "self_attn.q_proj.biases": np.zeros((64, 1), np.float16),  # mlx-lm
        p + "mlp.up_proj.qweight": np.zeros((8, 128), np.int32), p + "mlp.up_proj.qzeros": np.zeros((1, 16), np.int32),
        p + "mlp.up_proj.scales": np.zeros((1, 128), np.float16), p + "mlp.up_proj.g_idx": np.zeros(64, np.int32),  # GPTQ
        p + "mlp.down_proj.weight": np.zeros((4096, 1), np.uint8),
        p + "mlp.down_proj.weight.absmax": np.zeros(64, np.float32),  # bitsandbytes
    }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_quantized_targets_keep_packed_tensors_but_not_a_relabelled_norm(tmp_path):
    from speculant.core.target_check import target_tensor_problems
    from speculant.core.validator import read_target_info

    folder = _quantized_folder(tmp_path, quantized=True)
    stored_as = [m for m in target_tensor_problems(folder, read_target_info(folder)) if "stored as" in m]
    assert stored_as == []
    relabel(folder / "model.safetensors", "model.layers.0.input_layernorm.weight", "I32")
    stored_as = [m for m in target_tensor_problems(folder, read_target_info(folder)) if "stored as" in m]
    assert stored_as == ["model.safetensors: tensor model.layers.0.input_layernorm.weight is stored as I32, "
                         f"{FLOATS} for an unquantized weight"]
    # the same packed tensors in a folder whose config.json declares no quantization are refused
    plain = _quantized_folder(tmp_path, quantized=False)
    refused = {m.split("tensor ")[1].split(" is")[0] for m in target_tensor_problems(plain, read_target_info(plain))
               if "stored as" in m}
    assert refused == {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                       "model.layers.0.mlp.up_proj.qweight", "model.layers.0.mlp.up_proj.qzeros",
                       "model.layers.0.mlp.up_proj.g_idx", "model.layers.0.mlp.down_proj.weight"}


# -- Confusing: each damaged file is one line naming it -----------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_corrupt_tokenizer_json_is_named(capsys, tmp_path, models, backend):
    needs(backend)
    (models["target"] / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    report = validate(config(models, backend))
    assert [p.field for p in report.errors] == ["target.path"]
    assert "tokenizer.json is not valid JSON" in report.errors[0].message
    assert_reported(capsys, tmp_path, config(models, backend), "tokenizer.json", "not valid JSON")


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_tokenizer_the_library_cannot_parse_is_a_checkpoint_error(models, backend):
    """Valid JSON that is no tokenizer: the loader's error names the folder instead of a KeyError."""
    needs(backend)
    (models["target"] / "tokenizer.json").write_text('{"version": "1.0"}')
    info = validate(config(models, backend)).target
    loaded = get_registry().backends[backend](BackendConfig(kind=backend, device="cpu", dtype="float32"))
    with pytest.raises(CheckpointError, match=rf"the tokenizer in {models['target']} cannot be loaded"):
        loaded.load_target(str(models["target"]), info)


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_unknown_model_type_names_it_and_the_tested_families(capsys, tmp_path, models, backend):
    needs(backend)
    file = models["target"] / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "model_type": "qwen9"}))
    report = validate(config(models, backend))
    assert [p.field for p in report.errors] == ["target.path"], report.errors
    message = report.errors[0].message
    assert all(w in message for w in (str(file), "'qwen9'", "llama, qwen3")) and "pip install" not in message
    assert_reported(capsys, tmp_path, config(models, backend), "config.json", "'qwen9'", "llama, qwen3")
    loaded = get_registry().backends[backend](BackendConfig(kind=backend, device="cpu", dtype="float32"))
    with pytest.raises(ConfigError, match="'qwen9'") as caught:
        loaded.load_target(str(models["target"]), report.target)
    assert "pip install" not in str(caught.value)


def test_deeply_nested_header_is_one_line_and_the_report_goes_on(capsys, tmp_path, models):
    rewrite_header(models["target"] / "model.safetensors", lambda h: b"[" * 200_000 + b"]" * 200_000)
    (models["dflash"] / "config.json").write_text("[]")  # a second, unrelated problem
    data = config(models, drafter="dflash")
    report = validate(data)
    messages = [p.message for p in report.errors]
    assert len(messages) == 2, messages
    assert "model.safetensors is not a readable safetensors file" in messages[0] and "nested too deeply" in messages[0]
    assert str(models["dflash"] / "config.json") in messages[1]
    assert_reported(capsys, tmp_path, data, "model.safetensors", "nested too deeply")


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "mtp"])
def test_draft_header_that_is_a_json_list_names_the_file(capsys, tmp_path, models, kind):
    rewrite_header(models[kind] / "model.safetensors", lambda h: [1, 2])
    data = config(models, drafter=kind)
    report = validate(data)
    assert [p.field for p in report.errors] == ["drafter.path"], report.errors
    assert f"{models[kind] / 'model.safetensors'} is not a readable safetensors file" in report.errors[0].message
    assert_reported(capsys, tmp_path, data, "model.safetensors", "JSON list")


def test_malformed_tensor_entry_in_a_draft_header_is_named(models):
    rewrite_header(models["dflash"] / "model.safetensors", lambda h: {**h, "fc.weight": {"dtype": "F32"}})
    report = validate(config(models, drafter="dflash"))
    assert [p.field for p in report.errors] == ["drafter.path"], report.errors
    assert "tensor fc.weight has a malformed header entry" in report.errors[0].message


# -- every problem at once -------------------------------------------------------------------------
def test_one_bad_file_hides_no_other(models):
    relabel(models["target"] / "model.safetensors", "model." + UP, "I32")
    (models["target"] / "tokenizer.json").write_text("{")
    (models["target"] / "generation_config.json").write_text("{")
    rewrite_header(models["dflash"] / "model.safetensors", lambda h: [1])
    report = validate(config(models, drafter="dflash"))
    found = sorted(p.message.split(": ")[1].split(" ")[0] for p in report.errors if p.field == "target.path")
    assert found == ["generation_config.json", "model.safetensors", "tokenizer.json"], report.errors
    assert any("JSON list" in p.message for p in report.errors if p.field == "drafter.path"), report.errors
    # an unreadable config.json still leaves the other files checked, the draft's included
    (models["target"] / "config.json").write_text("[]")
    messages = " | ".join(p.message for p in validate(config(models, drafter="dflash")).errors)
    for word in ("config.json is not valid", "tokenizer.json", "generation_config.json", "JSON list"):
        assert word in messages, messages
