"""The compatibility validator: one test per check, plus one config that breaks many at once.

Targets and drafts are folders written here by hand (config.json plus safetensors headers with
the published tensor names); the validator reads configs and headers only, never weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict
from safetensors.numpy import save_file

from speculant.core.errors import ConfigError
from speculant.core.interfaces import Backend, DrafterFactory, Verifier
from speculant.core.types import DrafterInfo, ProposalKind
from speculant.core.problems import Problem
from speculant.api import validate
from speculant.plugins import Registry, hookimpl

VOCAB, HIDDEN, LAYERS = 320, 64, 4


# -- model folders ------------------------------------------------------------------------------
def write_target(root: Path, weights: bool = True, **overrides) -> Path:
    path = root / "target"
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 192, "max_position_embeddings": 512, "eos_token_id": 0,
    }
    config.update(overrides)
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        save_file({"model.norm.weight": np.ones(HIDDEN, np.float32)}, str(path / "model.safetensors"))
    return path


def write_dflash(root: Path, hidden: int = HIDDEN, vocab: int = VOCAB, layer_ids=(1, 2), mask: int = VOCAB - 1,
                 block: int = 8, num_target_layers: int = LAYERS) -> Path:
    """A DFlash draft in the published layout (dflash-v1 1.2 keys, 1.3 tensor names)."""
    path = root / "draft"
    path.mkdir(parents=True, exist_ok=True)
    heads, kv, hd, inter, n = 4, 2, 16, 3 * hidden, 1
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": block,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(layer_ids)},
        "hidden_size": hidden, "num_hidden_layers": n, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hd, "intermediate_size": inter, "num_target_layers": num_target_layers,
        "layer_types": ["full_attention"] * n, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": vocab, "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    shapes = {"fc.weight": (hidden, len(layer_ids) * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(n):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv * hd, hidden),
            p + "self_attn.v_proj.weight": (kv * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        })
    save_file({k: np.zeros(s, np.float32) for k, s in shapes.items()}, str(path / "model.safetensors"))
    return path


# -- a test plugin for checks the built-ins cannot trigger -----------------------------------
class RefBackend(Backend):
    name = "cpu_ref"

    @classmethod
    def supported_dtypes(cls):
        return ("auto", "float32")

    @property
    def device(self):
        return "cpu"

    def load_target(self, path, info):
        raise NotImplementedError


class AbsentBackend(RefBackend):
    name = "absent"

    @classmethod
    def availability_problem(cls):
        return "the absent backend needs the frobnicate package, which is not installed"


class DenseOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = 2


class DenseDrafterFactory(DrafterFactory):
    """Config-level only: proposes dense distributions and does not say its block size."""

    name = "dense_stub"
    backends = ("torch",)
    options_model = DenseOptions

    def describe(self, config, target, backend):
        return DrafterInfo(kind=self.name, proposal_kinds=(ProposalKind.DENSE,), backends=self.backends), []

    def load(self, config, info, backend, target):
        raise NotImplementedError


class ThresholdOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    threshold: float = 0.5


class OneHotSampler(Verifier):
    name = "one_hot_sampler"
    accepts = (ProposalKind.ONE_HOT,)
    supports_sampling = True
    options_model = ThresholdOptions

    def verify(self, ops, draft, target_logits, sampling, rng):
        raise NotImplementedError


class ValidatorTestPlugin:
    @hookimpl
    def register_backends(self, register):
        register(RefBackend)
        register(AbsentBackend)

    @hookimpl
    def register_drafters(self, register):
        register(DenseDrafterFactory())

    @hookimpl
    def register_verifiers(self, register):
        register(OneHotSampler)

    @hookimpl
    def check_pairing(self, config, target):
        if config.generation.max_new_tokens == 6666:
            raise RuntimeError("check exploded")
        if config.generation.max_new_tokens == 7777:
            return [Problem("generation.max_new_tokens", "7777 is unlucky for this plugin", "pick another number")]
        return []


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")  # built-ins only, whatever is installed here
    reg = Registry().load()
    reg.add_plugin(ValidatorTestPlugin(), "validator-tests")
    for kind, name in (("backends", "torch"), ("drafters", "dflash"), ("verifiers", "greedy")):
        assert name in getattr(reg, kind), reg.missing_hint(kind, name)
    return reg


@pytest.fixture
def pair(tmp_path):
    return write_target(tmp_path), write_dflash(tmp_path)


def config_for(pair, **sections) -> dict:
    target, draft = pair
    config = {
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
        "target": {"path": str(target)},
        "drafter": {"kind": "dflash", "path": str(draft)},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def problems(config, registry) -> list[Problem]:
    return validate(config, registry).problems


def only(config, registry, field: str, *phrases: str) -> Problem:
    """Exactly one problem, on ``field``, whose message mentions every phrase and that has a fix."""
    found = problems(config, registry)
    assert [p.field for p in found] == [field], [str(p) for p in found]
    problem = found[0]
    for phrase in phrases:
        assert phrase in problem.message, problem
    assert problem.fix, problem
    return problem


# -- the clean pairing ------------------------------------------------------------------------
def test_clean_pairing_has_no_problems(pair, registry):
    report = validate(config_for(pair), registry)
    assert report.problems == [] and report.ok
    assert report.target.vocab_size == VOCAB and report.drafter.trained_block_size == 8
    assert report.drafter.target_layer_ids == (1, 2)


def test_plain_decoding_needs_no_drafter(pair, registry):
    config = config_for(pair)
    config["drafter"] = {"kind": "none"}
    assert problems(config, registry) == []


# -- backend ----------------------------------------------------------------------------------
def test_unknown_backend_kind(pair, registry):
    found = problems(config_for(pair, backend={"kind": "tpu"}), registry)
    assert [p.field for p in found] == ["backend.kind", "drafter.kind"]  # the drafter cannot run on it either
    assert "no backend named 'tpu'" in found[0].message and "torch" in found[0].message
    only(config_for(pair, backend={"kind": "tpu"}, drafter={"kind": "none"}), registry, "backend.kind", "'tpu'")


def test_unavailable_backend(pair, registry):
    found = problems(config_for(pair, backend={"kind": "absent"}), registry)
    assert [p.field for p in found] == ["backend.kind", "drafter.kind"]
    assert "frobnicate" in found[0].message and "speculant[absent]" in found[0].fix


def test_unsupported_dtype(pair, registry):
    only(config_for(pair, backend={"dtype": "int3"}), registry, "backend.dtype", "'int3'")


# -- target -----------------------------------------------------------------------------------
def test_target_path_missing(tmp_path, registry):
    config = config_for((tmp_path / "nowhere", write_dflash(tmp_path)))
    only(config, registry, "target.path", "is not a directory")


def test_target_without_config_json(tmp_path, registry):
    target = write_target(tmp_path)
    (target / "config.json").unlink()
    only(config_for((target, write_dflash(tmp_path))), registry, "target.path", "no config.json")


def test_target_without_safetensors(tmp_path, registry):
    target = write_target(tmp_path, weights=False)
    (target / "pytorch_model.bin").write_bytes(b"pickle")
    only(config_for((target, write_dflash(tmp_path))), registry, "target.path", "no *.safetensors")


def test_target_config_without_sizes(tmp_path, registry):
    target = write_target(tmp_path, vocab_size=None)
    only(config_for((target, write_dflash(tmp_path))), registry, "target.path", "vocab_size")


# -- sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling, field",
    [
        ({"temperature": -0.5}, "sampling.temperature"),
        ({"temperature": 5e-324}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_p": 1.5}, "sampling.top_p"),
        ({"top_k": -1}, "sampling.top_k"),
    ],
)
def test_sampling_out_of_range(pair, registry, sampling, field):
    only(config_for(pair, sampling=sampling), registry, field)


@pytest.mark.parametrize("section, values, field", [
    ("sampling", {"temperature": math.nan}, "sampling.temperature"),
    ("drafter", {"block_size": 0}, "drafter.block_size"),
    ("drafter", {"block_size": -3}, "drafter.block_size"),
])
def test_non_finite_or_sub_one_values_are_config_errors(pair, registry, section, values, field):
    """Non-finite floats and sizes below any bound are config errors naming the field."""
    with pytest.raises(ConfigError) as info:
        validate(config_for(pair, **{section: values}), registry)
    assert info.value.field == field


# -- drafter ----------------------------------------------------------------------------------
def test_unknown_drafter_kind(pair, registry):
    only(config_for(pair, drafter={"kind": "eagle9"}), registry, "drafter.kind", "no drafter named 'eagle9'", "dflash")


def test_unknown_drafter_kind_mentions_failed_plugins(pair, monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")
    registry = Registry().load(extra_modules=("speculant_no_such_plugin",))
    found = problems(config_for(pair, drafter={"kind": "eagle9"}), registry)
    # the plugin asked for by name is an error of its own (tests/test_faults.py), and the hint repeats why
    assert [p.field for p in found] == ["plugins", "drafter.kind"], [str(p) for p in found]
    assert "failed to load" in found[1].message and "speculant_no_such_plugin" in found[1].message


def test_drafter_does_not_support_backend(pair, registry):
    only(config_for(pair, backend={"kind": "cpu_ref"}), registry, "drafter.kind",
         "dflash drafter does not support the cpu_ref backend")


def test_drafter_options_invalid(pair, registry):
    config = config_for(pair, drafter={"kind": "dense_stub", "block_size": 4, "options": {"widht": 3}})
    only(config, registry, "drafter.options", "invalid options for dense_stub", "widht")


def test_drafter_checkpoint_problems_come_from_the_factory(tmp_path, registry):
    target, draft = write_target(tmp_path), write_dflash(tmp_path)
    (draft / "config.json").unlink()
    only(config_for((target, draft)), registry, "drafter.path", "no config.json")
    config = config_for((target, draft))
    del config["drafter"]["path"]
    only(config, registry, "drafter.path", "needs a checkpoint folder")


def test_vocab_mismatch(tmp_path, registry):
    pair = (write_target(tmp_path), write_dflash(tmp_path, vocab=VOCAB + 64))
    only(config_for(pair), registry, "drafter.path", f"vocab_size {VOCAB + 64} != target vocab_size {VOCAB}")


def test_hidden_mismatch(tmp_path, registry):
    pair = (write_target(tmp_path), write_dflash(tmp_path, hidden=32))
    only(config_for(pair), registry, "drafter.path", f"hidden_size 32 != target hidden_size {HIDDEN}")


def test_num_target_layers_mismatch(tmp_path, registry):
    pair = (write_target(tmp_path), write_dflash(tmp_path, num_target_layers=36))
    only(config_for(pair), registry, "drafter.path", f"num_target_layers 36 != target num_hidden_layers {LAYERS}")


def test_target_layer_ids_out_of_range(tmp_path, registry):
    pair = (write_target(tmp_path), write_dflash(tmp_path, layer_ids=(1, LAYERS)))
    p = only(config_for(pair), registry, "drafter.path", f"target_layer_ids entry {LAYERS} does not exist")
    assert f"0..{LAYERS - 1}" in p.message


def test_mask_token_outside_vocab(tmp_path, registry):
    pair = (write_target(tmp_path), write_dflash(tmp_path, mask=VOCAB))
    only(config_for(pair), registry, "drafter.path", f"mask_token_id {VOCAB} is outside the target vocabulary")


@pytest.mark.parametrize("block", [1])
def test_block_size_below_two(pair, registry, block):
    only(config_for(pair, drafter={"block_size": block}), registry, "drafter.block_size", "below 2")


def test_block_size_above_trained(pair, registry):
    p = only(config_for(pair, drafter={"block_size": 9}), registry, "drafter.block_size", "exceeds", "trained block size 8")
    assert "between 2 and 8" in p.fix
    assert problems(config_for(pair, drafter={"block_size": 8}), registry) == []
    assert problems(config_for(pair, drafter={"block_size": 2}), registry) == []


def test_block_size_needed_when_the_draft_does_not_say(pair, registry):
    only(config_for(pair, drafter={"kind": "dense_stub"}), registry, "drafter.block_size", "does not say its block size")
    assert problems(config_for(pair, drafter={"kind": "dense_stub", "block_size": 4}), registry) == []


# -- quantization -----------------------------------------------------------------------------
def test_quantization_spec_unparseable(pair, registry):
    only(config_for(pair, drafter={"quantization": "int4-please"}), registry, "drafter.quantization", "cannot parse")


@pytest.mark.parametrize(
    "spec, field",
    [
        ("w3a16:gs64", "drafter.quantization.weight_bits"),
        ("w4a8:gs64", "drafter.quantization.activation_bits"),
        ("w4a16:gs48", "drafter.quantization.group_size"),
        ({"weight_bits": 4, "group_size": 256}, "drafter.quantization.group_size"),
    ],
)
def test_quantization_values_unsupported(pair, registry, spec, field):
    only(config_for(pair, drafter={"quantization": spec}), registry, field, "is not supported")


def test_quantization_valid_specs_pass(pair, registry):
    for spec in ("w4a16:gs64", "w8", "off", {"weight_bits": 2, "group_size": 32}):
        assert problems(config_for(pair, drafter={"quantization": spec}), registry) == []


# -- verifier ---------------------------------------------------------------------------------
def test_unknown_verifier_kind(pair, registry):
    only(config_for(pair, verifier={"kind": "typical"}), registry, "verifier.kind", "no verifier named 'typical'", "greedy")


def test_greedy_verifier_with_temperature(pair, registry):
    p = only(config_for(pair, verifier={"kind": "greedy"}, sampling={"temperature": 0.8}), registry, "verifier.kind",
             "only supports greedy decoding", "0.8")
    assert "speculative_sampling" in p.fix
    assert problems(config_for(pair, verifier={"kind": "greedy"}), registry) == []
    assert problems(config_for(pair, verifier={"kind": "auto"}, sampling={"temperature": 0.8}), registry) == []


def test_verifier_does_not_accept_the_proposals(pair, registry):
    config = config_for(pair, drafter={"kind": "dense_stub", "block_size": 4}, verifier={"kind": "one_hot_sampler"},
                        sampling={"temperature": 1.0})
    only(config, registry, "verifier.kind", "does not accept dense proposals from the dense_stub drafter")
    config["sampling"]["temperature"] = 0.0  # greedy verification needs no draft probabilities
    assert problems(config, registry) == []


def test_verifier_options_invalid(pair, registry):
    config = config_for(pair, verifier={"kind": "one_hot_sampler", "options": {"treshold": 1}})
    only(config, registry, "verifier.options", "invalid options for one_hot_sampler", "treshold")


# -- plugin checks ----------------------------------------------------------------------------
def test_plugin_check_pairing_problems_are_included(pair, registry):
    only(config_for(pair, generation={"max_new_tokens": 7777}), registry, "generation.max_new_tokens", "unlucky")


def test_a_plugin_check_that_raises_becomes_a_problem(pair, registry):
    p = only(config_for(pair, generation={"max_new_tokens": 6666}), registry, "plugins", "check exploded")
    assert "validator-tests" in p.message


# -- everything at once -----------------------------------------------------------------------
def test_every_problem_is_reported_at_once(tmp_path, registry):
    target = write_target(tmp_path)
    draft = write_dflash(tmp_path, vocab=VOCAB + 1, hidden=32, layer_ids=(1, 7), mask=VOCAB + 5)
    config = config_for(
        (target, draft),
        backend={"dtype": "float8"},
        drafter={"block_size": 12, "quantization": "w5"},
        verifier={"kind": "greedy"},
        sampling={"temperature": 0.7, "top_p": 2.0, "top_k": -4},
    )
    report = validate(config, registry)
    text = "\n".join(map(str, report.problems))
    expected = [
        ("backend.dtype", "'float8'"),
        ("sampling.top_p", "2.0"),
        ("sampling.top_k", "-4"),
        ("drafter.quantization.weight_bits", "5"),
        ("drafter.path", "vocab_size"),
        ("drafter.path", "hidden_size 32"),
        ("drafter.path", "entry 7"),
        ("drafter.path", f"mask_token_id {VOCAB + 5}"),
        ("drafter.block_size", "12"),
        ("verifier.kind", "only supports greedy"),
    ]
    for field, phrase in expected:
        assert any(p.field == field and phrase in p.message for p in report.problems), (field, phrase, text)
    assert len(report.errors) == len(expected), text
    assert all(p.fix for p in report.problems)
    assert not report.ok
