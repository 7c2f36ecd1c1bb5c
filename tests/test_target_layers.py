"""Each target layer's kind is known before any weights load, and a speculative pairing whose
caches the backend cannot roll back is refused by the validator, naming the layer kind and family."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from speculant.api import validate
from speculant.core.validator import layer_types, read_target_info
from speculant.plugins import Registry

F, S, L = "full_attention", "sliding_attention", "linear_attention"
BASE = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4}


@pytest.mark.parametrize("extra,expected", [
    ({}, (F,) * 4),
    ({"layer_types": [L, L, L, F]}, (L, L, L, F)),
    ({"full_attention_interval": 4}, (L, L, L, F)),  # Qwen3-Next / Qwen3.5 Hub configs
    ({"sliding_window": 16}, (S,) * 4),  # Mistral
    ({"sliding_window": 16, "use_sliding_window": False}, (F,) * 4),  # Qwen2/3 with the window off
    ({"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}, (F, F, S, S)),
    ({"sliding_window": 16, "sliding_window_pattern": 2}, (S, F, S, F)),  # Gemma 3 before layer_types
    ({"sliding_window": None}, (F,) * 4),
    ({"layer_types": [F, F]}, (F,) * 4),  # a list of the wrong length is not trusted
])
def test_layer_types_from_each_family_convention(extra, expected):
    assert layer_types({**BASE, **extra}) == expected


def test_composite_configs_read_the_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5", "text_config": {**BASE, "model_type": "qwen3_5_text", "layer_types": [L, L, L, F]},
    }))
    info = read_target_info(tmp_path)
    assert info.layer_types == (L, L, L, F) and info.model_type == "qwen3_5_text"


def write_target(folder, **extra):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "made_up", **BASE, **extra}))
    save_file({"w": np.zeros(1, np.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def registry():
    return Registry().load()


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_an_unknown_layer_kind_is_refused_before_weights_load(tmp_path, registry, backend):
    if registry.backends[backend].availability_problem():
        pytest.skip(f"{backend} is not available here")
    target = write_target(tmp_path / "t", layer_types=[L, "indexed_attention", L, F])
    config = {"backend": {"kind": backend}, "target": {"path": str(target)}, "drafter": {"lookup": True}}
    # (the made-up model_type is an error of its own, from the backend's family check)
    found = [p for p in validate(config, registry).errors if p.field == "target.path" and "roll back" in p.message]
    assert len(found) == 1, [str(p) for p in validate(config, registry).problems]
    assert "indexed_attention" in found[0].message and "made_up" in found[0].message
    assert found[0].fix
    # plain decoding never rolls back: the same target is fine without speculation
    plain = {**config, "drafter": {"kind": "none"}}
    assert not [p for p in validate(plain, registry).errors if p.field == "target.path" and "roll back" in p.message]
