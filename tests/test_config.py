"""EngineConfig loading: formats, strictness, field paths in errors, relative paths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from speculant.core.config import EngineConfig, QuantizationConfig, parse_quantization
from speculant.core.errors import ConfigError

TOML = """
[backend]
kind = "torch"
dtype = "float32"

[target]
path = "models/target"

[drafter]
kind = "dflash"
path = "models/draft"
block_size = 8

[sampling]
temperature = 0.7
top_p = 0.9
seed = 3

[generation]
max_new_tokens = 32
stop_strings = ["\\n\\n"]
"""


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_toml_file_loads_every_section(tmp_path):
    config = EngineConfig.load(write(tmp_path, "engine.toml", TOML))
    assert config.backend.dtype == "float32"
    assert config.drafter.kind == "dflash" and config.drafter.block_size == 8
    assert config.sampling.temperature == 0.7 and config.sampling.top_p == 0.9 and config.sampling.seed == 3
    assert config.generation.max_new_tokens == 32 and config.generation.stop_strings == ["\n\n"]
    assert config.verifier.kind == "auto"


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    sub = tmp_path / "configs"
    sub.mkdir()
    config = EngineConfig.load(str(write(sub, "engine.toml", TOML)))
    assert config.target.path == sub.resolve() / "models/target"
    assert config.drafter.path == sub.resolve() / "models/draft"


def test_absolute_paths_stay_and_dict_paths_are_not_rebased(tmp_path):
    text = TOML.replace('"models/target"', json.dumps(str(tmp_path / "abs")))
    config = EngineConfig.load(write(tmp_path, "engine.toml", text))
    assert config.target.path == tmp_path / "abs"
    from_dict = EngineConfig.load({"target": {"path": "rel/target"}})
    assert from_dict.target.path == Path("rel/target")


def test_yaml_and_json_load_the_same_config(tmp_path):
    data = {"target": {"path": "t"}, "drafter": {"kind": "dflash", "path": "d", "block_size": 4},
            "sampling": {"temperature": 1.0, "top_k": 20}}
    yaml_text = "target:\n  path: t\ndrafter:\n  kind: dflash\n  path: d\n  block_size: 4\nsampling:\n  temperature: 1.0\n  top_k: 20\n"
    from_yaml = EngineConfig.load(write(tmp_path, "e.yaml", yaml_text))
    from_yml = EngineConfig.load(write(tmp_path, "e.yml", yaml_text))
    from_json = EngineConfig.load(write(tmp_path, "e.json", json.dumps(data)))
    assert from_yaml == from_yml == from_json
    assert from_json.target.path == tmp_path.resolve() / "t"
    assert from_json.sampling.top_k == 20 and from_json.drafter.block_size == 4


def test_dict_and_model_sources():
    config = EngineConfig.load({"target": {"path": "/m"}})
    assert EngineConfig.load(config) is config
    assert config.drafter.enabled is False
    assert EngineConfig.load({"target": {"path": "/m"}, "drafter": {"kind": "none"}}).drafter.enabled is False
    assert EngineConfig.load({"target": {"path": "/m"}, "drafter": {"kind": "dflash"}}).drafter.enabled is True


@pytest.mark.parametrize(
    "data, field",
    [
        ({"target": {"path": "/m"}, "drafter": {"blok_size": 4}}, "drafter.blok_size"),
        ({"target": {"path": "/m"}, "sampling": {"temprature": 0.5}}, "sampling.temprature"),
        ({"target": {"path": "/m"}, "engine": {}}, "engine"),
        ({"target": {"path": "/m", "revision": "main"}}, "target.revision"),
    ],
)
def test_unknown_key_names_the_dotted_field(data, field):
    with pytest.raises(ConfigError) as err:
        EngineConfig.load(data)
    assert f"{field}: unknown key" in str(err.value)


@pytest.mark.parametrize(
    "data, field",
    [
        ({"target": {"path": "/m"}, "drafter": {"block_size": "eight"}}, "drafter.block_size"),
        ({"target": {"path": "/m"}, "sampling": {"temperature": "hot"}}, "sampling.temperature"),
        ({"target": {"path": "/m"}, "generation": {"stop_token_ids": 5}}, "generation.stop_token_ids"),
        ({"target": {"path": "/m"}, "generation": {"max_new_tokens": 0}}, "generation.max_new_tokens"),
        ({"target": "model-folder"}, "target"),
    ],
)
def test_wrong_type_names_the_dotted_field(data, field):
    with pytest.raises(ConfigError) as err:
        EngineConfig.load(data)
    assert f"  - {field}:" in str(err.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        EngineConfig.load({"drafter": {"block_size": "x", "colour": 1}})
    text = str(err.value)
    assert "target: required key is missing" in text
    assert "drafter.block_size" in text and "drafter.colour: unknown key" in text


def test_wrong_type_in_a_toml_file_names_the_field(tmp_path):
    path = write(tmp_path, "engine.toml", TOML.replace("block_size = 8", 'block_size = "big"'))
    with pytest.raises(ConfigError, match=r"drafter\.block_size"):
        EngineConfig.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        EngineConfig.load(tmp_path / "nope.toml")


def test_unparseable_toml_names_the_file(tmp_path):
    path = write(tmp_path, "engine.toml", "[target\npath = 1\n")
    with pytest.raises(ConfigError) as err:
        EngineConfig.load(path)
    assert "cannot parse" in str(err.value) and str(path) in str(err.value) and "TOML" in str(err.value)


def test_unreadable_file_is_a_config_error(tmp_path):
    path = write(tmp_path, "engine.toml", b"\xff\xfe\x00 not utf-8 \x80")
    with pytest.raises(ConfigError, match="cannot read config file"):
        EngineConfig.load(path)


@pytest.mark.parametrize("name, text", [("e.yaml", "target: [unclosed\n"), ("e.json", "{'target': 1}")])
def test_unparseable_yaml_and_json(tmp_path, name, text):
    with pytest.raises(ConfigError, match="cannot parse"):
        EngineConfig.load(write(tmp_path, name, text))


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="must be a table/mapping"):
        EngineConfig.load(write(tmp_path, "e.yaml", "- target\n- drafter\n"))


def test_unknown_extension(tmp_path):
    with pytest.raises(ConfigError, match="unknown config format"):
        EngineConfig.load(write(tmp_path, "engine.ini", "[target]\npath=x\n"))


def test_empty_yaml_reports_the_missing_target(tmp_path):
    with pytest.raises(ConfigError, match="target: required key is missing"):
        EngineConfig.load(write(tmp_path, "e.yaml", ""))


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("w4a16:gs64", QuantizationConfig(weight_bits=4, activation_bits=16, group_size=64)),
        ("w8", QuantizationConfig(weight_bits=8, activation_bits=16, group_size=64)),
        ("W4:gs32", QuantizationConfig(weight_bits=4, activation_bits=16, group_size=32)),
        ("w4:gs32:all", QuantizationConfig(weight_bits=4, activation_bits=16, group_size=32, quantize_all=True)),
        ("w8:all", QuantizationConfig(weight_bits=8, activation_bits=16, group_size=64, quantize_all=True)),
        ("off", None),
        (None, None),
    ],
)
def test_quantization_specs_parse(spec, expected):
    assert parse_quantization(spec) == expected


@pytest.mark.parametrize("spec", ["int4", "w4:g64", "wfour", "w4a16:gsx", "w4:all:gs64", "w4:gs32:gs64"])
def test_bad_quantization_specs_raise(spec):
    with pytest.raises(ConfigError, match="drafter.quantization"):
        parse_quantization(spec)


# -- issue 37: strict, finite, bounded ----------------------------------------------------------
BASE = {"target": {"path": "/m"}}


def load_section(section: str, values: dict) -> EngineConfig:
    return EngineConfig.load({**BASE, section: values})


@pytest.mark.parametrize("section, values, field, allowed", [
    ("drafter", {"lookup": {"enabled": True, "max_match": 1_000_000_000}}, "drafter.lookup.max_match", "≤ 64"),
    ("drafter", {"lookup": {"min_match": 65}}, "drafter.lookup.min_match", "≥ 1 and ≤ 64"),
    ("drafter", {"kind": "dflash", "block_size": 100_000}, "drafter.block_size", "≤ 256"),
    ("generation", {"max_new_tokens": 10**12}, "generation.max_new_tokens", "≥ 1 and ≤ 16777216"),
    ("generation", {"stop_token_ids": [2**40]}, "generation.stop_token_ids.0", "≤ 2147483647"),
    ("generation", {"stop_token_ids": list(range(2000))}, "generation.stop_token_ids", "at most 1024"),
    ("generation", {"stop_strings": ["x" * 5000]}, "generation.stop_strings.0", "at most 1024"),
    ("sampling", {"top_k": 2**40}, "sampling.top_k", "≤ 16777216"),
    ("sampling", {"seed": 2**70}, "sampling.seed", "≤ 18446744073709551615"),
    ("drafter", {"quantization": {"group_size": 10**9}}, "drafter.quantization", "≤ 4096"),
])
def test_sizes_have_a_maximum_named_with_the_field(section, values, field, allowed):
    with pytest.raises(ConfigError) as err:
        load_section(section, values)
    line = next(line for line in str(err.value).splitlines() if field in line)
    assert "out of range" in line or "at most" in line, line
    assert allowed in line and "https://" not in str(err.value)


@pytest.mark.parametrize("section, values, field", [
    ("sampling", {"temperature": math.inf}, "sampling.temperature"),
    ("sampling", {"temperature": math.nan}, "sampling.temperature"),
    ("sampling", {"top_p": -math.inf}, "sampling.top_p"),
])
def test_non_finite_floats_are_refused(section, values, field):
    with pytest.raises(ConfigError) as err:
        load_section(section, values)
    assert f"{field}: " in str(err.value) and "finite" in str(err.value) and err.value.field == field


@pytest.mark.parametrize("section, values, field", [
    ("sampling", {"temperature": True}, "sampling.temperature"),
    ("generation", {"max_new_tokens": True}, "generation.max_new_tokens"),
    ("generation", {"max_new_tokens": 2.0}, "generation.max_new_tokens"),
    ("sampling", {"seed": False}, "sampling.seed"),
    ("sampling", {"seed": "7"}, "sampling.seed"),
    ("generation", {"stop_token_ids": [True, 1.0]}, "generation.stop_token_ids.0"),
    ("generation", {"ignore_eos": "no"}, "generation.ignore_eos"),
    ("drafter", {"block_size": "4"}, "drafter.block_size"),
    ("drafter", {"lookup": {"enabled": 1}}, "drafter.lookup.enabled"),
    ("backend", {"device": 0}, "backend.device"),
])
def test_values_are_taken_as_written(section, values, field):
    with pytest.raises(ConfigError) as err:
        load_section(section, values)
    assert err.value.field == field and "expected" in str(err.value), str(err.value)


def test_an_integer_is_a_fine_float_and_a_tuple_a_fine_list():
    config = EngineConfig.load({**BASE, "sampling": {"temperature": 1, "top_p": 1},
                                "generation": {"stop_token_ids": (3, 4)}})
    assert config.sampling.temperature == 1.0 and isinstance(config.sampling.temperature, float)
    assert config.generation.stop_token_ids == [3, 4]


def test_strict_types_from_a_toml_file(tmp_path):
    path = write(tmp_path, "engine.toml", TOML.replace("seed = 3", "seed = true"))
    with pytest.raises(ConfigError, match=r"sampling\.seed: expected an integer, got boolean true"):
        EngineConfig.load(path)
    EngineConfig.load(write(tmp_path, "ok.toml", TOML.replace("temperature = 0.7", "temperature = 1")))


def _user_models():
    from speculant.core.config import _Section
    from speculant.drafters.mtp.config import MTPOptions
    from speculant.verifiers.adaptive.options import AdaptiveOptions

    sections = [m for m in vars(__import__("speculant.core.config", fromlist=["x"])).values()
                if isinstance(m, type) and issubclass(m, _Section) and m is not _Section]
    return [*sections, AdaptiveOptions, MTPOptions]


@pytest.mark.parametrize("model", _user_models(), ids=lambda m: m.__name__)
def test_every_user_model_is_strict_and_every_size_has_a_maximum(model):
    import annotated_types as at

    from speculant.core.schema import UserModel

    assert issubclass(model, UserModel) and model.model_config["strict"] and not model.model_config["allow_inf_nan"]
    for name, field in model.model_fields.items():
        text = str(field.annotation)
        if "int" not in text or "bool" == text:
            continue
        metadata = [m for m in field.metadata]
        if "list[" in text:
            assert any(isinstance(m, at.MaxLen) for m in metadata), f"{model.__name__}.{name} has no length limit"
            continue
        assert any(isinstance(m, (at.Le, at.Lt)) for m in metadata), f"{model.__name__}.{name} has no maximum"


def _adaptive_problem(options: dict):
    from speculant.core.validator import _check_options
    from speculant.verifiers.adaptive.options import AdaptiveOptions

    found = []
    _check_options("verifier", "adaptive", AdaptiveOptions, options, found.append)
    return found


@pytest.mark.parametrize("options, key", [
    ({"cost_table": [1.0, 1.1], "draft_cost": math.inf}, "draft_cost"),
    ({"cost_table": [1.0, 1.1], "draft_cost": 1e308}, "draft_cost"),
    ({"hysteresis": math.nan}, "hysteresis"),
    ({"probe_interval": True}, "probe_interval"),
    ({"max_probe_interval": 10**12}, "max_probe_interval"),
])
def test_adaptive_option_errors_read_like_the_configs(options, key):
    [problem] = _adaptive_problem(options)
    assert problem.field == "verifier.options"
    assert f"invalid options for adaptive: {key}: " in problem.message
    assert "https://" not in problem.message and "\n" not in problem.message and "validation error" not in problem.message


def test_mtp_option_errors_read_like_the_configs():
    from speculant.core.validator import _check_options
    from speculant.drafters.mtp.config import MTPOptions

    found = []
    _check_options("drafter", "mtp", MTPOptions, {"sample_drafts": "yes", "layot": "qwen"}, found.append)
    [problem] = found
    assert "sample_drafts: expected true or false" in problem.message and "layot: unknown key" in problem.message
    assert "https://" not in problem.message


def test_the_largest_legal_adaptive_costs_do_not_overflow_the_policy():
    from speculant.verifiers.adaptive.options import AdaptiveOptions
    from speculant.verifiers.adaptive.policy import AdaptivePolicy

    options = AdaptiveOptions(cost_table=[1e-300, 1e9], draft_cost=1e9, probe_cycles=64, probe_budget=1e-300)
    policy = AdaptivePolicy(options)
    assert policy.min_interval() == options.max_probe_interval
    assert math.isfinite(policy.estimate(1, 10).plain_rate)
