"""Fuzzing what a user writes: config dicts, config files (TOML, JSON, YAML, raw bytes), plugin
options and per-call settings, with random values of every JSON/TOML type.

The property is only this: the input is accepted, or refused with speculant's own typed error;
never another exception, and nothing accepted holds a non-finite float or a size past its bound.
Examples are bounded (``SPECULANT_FUZZ_EXAMPLES`` scales them up for a longer local run) and
derandomized by default, so the suite stays fast and repeatable.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import annotated_types as at
import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel

import speculant
from speculant.core.config import MIN_TEMPERATURE, EngineConfig
from speculant.core.errors import ConfigError, SpeculantError
from speculant.core.problems import Problem
from speculant.core.schema import SEED_MAX, _metadata
from speculant.core.validator import _check_options, sampling_problems
from speculant.drafters.mtp.config import MTPOptions
from speculant.verifiers.adaptive.options import AdaptiveOptions

SCALE = int(os.environ.get("SPECULANT_FUZZ_EXAMPLES", "1"))
FUZZ = settings(max_examples=120 * SCALE, deadline=timedelta(seconds=5), derandomize=SCALE == 1,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# -- values -------------------------------------------------------------------------------------
EDGE_NUMBERS = st.sampled_from([0, 1, -1, 2, 3, 64, 65, 256, 257, 2**24, 2**31, 2**63, 2**64, 2**70, 10**30,
                                0.0, -0.0, 0.5, 1.0, 1.5, 1e-4, 5e-324, 1e308, -1e308, math.inf, -math.inf, math.nan])
SCALARS = st.one_of(st.none(), st.booleans(), EDGE_NUMBERS, st.integers(), st.floats(), st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=8)


def keys_of(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def section_of(model: type[BaseModel]) -> st.SearchStrategy[dict]:
    """A table of ``model``: its own keys (now and then a stranger) with any values."""
    keys = st.one_of(st.sampled_from(keys_of(model)), st.text(max_size=6))
    return st.dictionaries(keys, VALUES, max_size=4)


SECTIONS = {name: field.annotation for name, field in EngineConfig.model_fields.items()}
CONFIGS = st.fixed_dictionaries(
    {"target": st.one_of(st.just({"path": "/models/target"}), section_of(SECTIONS["target"]))},
    optional={name: st.one_of(section_of(model), VALUES) for name, model in SECTIONS.items() if name != "target"},
)

# -- what an accepted config may hold -------------------------------------------------------------
_CHECKS = ((at.Le, "le", lambda v, b: v <= b), (at.Lt, "lt", lambda v, b: v < b),
           (at.Ge, "ge", lambda v, b: v >= b), (at.Gt, "gt", lambda v, b: v > b))


def assert_sane(model: BaseModel, where: str = "") -> None:
    """Every float finite; every number inside its field's declared bounds (lists item by item)."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        path = f"{where}{name}"
        if isinstance(value, BaseModel):
            assert_sane(value, path + ".")
            continue
        if name == "options":  # checked by the plugin's own model: test_random_plugin_options
            continue
        items = value if isinstance(value, list) else [value]
        metadata = _metadata(type(model), (name, 0) if isinstance(value, list) else (name,)) or []
        for item in items:
            if isinstance(item, float):
                assert math.isfinite(item), f"{path} = {item}"
            if isinstance(item, (int, float)) and not isinstance(item, bool):
                for cls, attr, ok in _CHECKS:
                    for bound in (m for m in metadata if isinstance(m, cls)):
                        assert ok(item, getattr(bound, attr)), f"{path} = {item} is past {bound}"


def load_or_refuse(source) -> EngineConfig | None:
    try:
        config = EngineConfig.load(source)
    except ConfigError as exc:
        assert str(exc) and "https://" not in str(exc), str(exc)
        return None
    assert_sane(config)
    return config


# -- the config loader --------------------------------------------------------------------------
@FUZZ
@given(CONFIGS)
def test_random_config_dicts_load_or_name_the_field(data):
    config = load_or_refuse(data)
    if config is not None:
        for problem in sampling_problems(config.sampling):  # what validate adds on top
            assert problem.field.startswith("sampling.")


TOML_VALUES = st.sampled_from(["true", "false", "1", "-1", "0", "1.0", "inf", "-inf", "nan", "1e309", "5e-324",
                               "99999999999999999999", '"4"', '"x"', "[1, 2]", "[true, 1.0]", '["a"]', "{}",
                               '{ enabled = true, max_match = 1000000000 }', "1979-05-27", "0x10", "[[1]]", "'''a'''"])


def toml_texts() -> st.SearchStrategy[str]:
    """TOML built from the config's own tables and keys with edge-case literals (often valid)."""
    line = st.one_of(
        st.sampled_from([f"[{name}]" for name in SECTIONS] + ["[drafter.lookup]", "[drafter.options]",
                                                              "[verifier.options]", "[[target]]", "[x"]),
        st.tuples(st.sampled_from(sorted({k for m in SECTIONS.values() for k in keys_of(m)} | {"path", "zz"})),
                  TOML_VALUES).map(lambda kv: f"{kv[0]} = {kv[1]}"),
        st.text(max_size=12),
    )
    return st.lists(line, max_size=10).map(lambda lines: '[target]\npath = "/m"\n' + "\n".join(lines))


def load_file_or_refuse(suffix: str, content: bytes) -> EngineConfig | None:
    """``load_or_refuse`` of ``content`` as a file named ``engine<suffix>``, deleted afterwards
    (hypothesis runs each test hundreds of times: left behind, the files filled /tmp)."""
    with tempfile.TemporaryDirectory(prefix="speculant-fuzz-") as folder:
        path = Path(folder) / f"engine{suffix}"
        path.write_bytes(content)
        return load_or_refuse(path)


@FUZZ
@given(toml_texts())
def test_random_toml_files_load_or_name_the_problem(text):
    load_file_or_refuse(".toml", text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(CONFIGS, st.sampled_from([".json", ".yaml"]))
def test_random_json_and_yaml_files_load_or_name_the_problem(data, suffix):
    text = json.dumps(data) if suffix == ".json" else yaml.safe_dump(data, allow_unicode=True)
    load_file_or_refuse(suffix, text.encode("utf-8", "surrogatepass"))


@FUZZ
@given(st.one_of(st.binary(max_size=64), st.text(max_size=40).map(str.encode)),
       st.sampled_from([".toml", ".json", ".yaml", ".yml", ".ini"]))
def test_random_bytes_as_a_config_file_are_refused_cleanly(content, suffix):
    load_file_or_refuse(suffix, content)


def test_deeply_nested_config_files_are_refused_cleanly():
    for suffix, text in ((".json", "[" * 100_000), (".yaml", "[" * 100_000), (".toml", "a = " + "[" * 100_000)):
        assert load_file_or_refuse(suffix, text.encode()) is None


@FUZZ
@given(st.sampled_from([AdaptiveOptions, MTPOptions]).flatmap(lambda m: st.tuples(st.just(m), section_of(m))))
def test_random_plugin_options_are_problems_or_sane(model_and_options):
    model, options = model_and_options
    found: list[Problem] = []
    _check_options("verifier", model.__name__, model, options, found.append)
    if found:
        assert "https://" not in found[0].message and "\n" not in found[0].message
        return
    assert_sane(model.model_validate(options))


# -- per-call settings ----------------------------------------------------------------------------
PER_CALL = ["temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop_strings", "ignore_eos",
            "max_new_tokens", "block_size", "prompt_ids"]
CALL_VALUES = st.one_of(VALUES, st.sets(st.integers(0, 300), max_size=3), st.tuples(st.integers(0, 300)),
                        st.binary(max_size=3), st.lists(st.integers(0, 300), min_size=1, max_size=4))


@pytest.fixture(scope="module")
def engine(planted_pair):
    return speculant.load_engine({
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(planted_pair["target"])},
        "drafter": {"kind": "dflash", "path": str(planted_pair["draft"]), "lookup": True},
    })


def test_random_per_call_settings_reach_the_loop_only_when_sane(engine):
    captured: list = []
    engine._stream = lambda *settings: captured.append(settings) or iter(())  # what the loop would be given
    limit = engine.drafter.info.block_limit
    vocab = engine.target.info.vocab_size

    @FUZZ
    @given(st.dictionaries(st.one_of(st.sampled_from(PER_CALL), st.text(max_size=5)), CALL_VALUES, max_size=4))
    def check(kwargs):
        kwargs.setdefault("prompt_ids", [5, 6, 7])
        captured.clear()
        try:
            engine.generate(**kwargs)
        except SpeculantError as exc:
            assert isinstance(exc, ValueError) and getattr(exc, "field", None) is not None, exc
            assert "https://" not in str(exc), str(exc)
            return
        [(ids, sampling, generation, block)] = captured
        assert all(isinstance(t, int) and 0 <= t < vocab for t in ids)
        assert_sane(sampling)
        assert_sane(generation)
        assert sampling.temperature == 0 or sampling.temperature >= MIN_TEMPERATURE
        assert 0 < sampling.top_p <= 1 and sampling.top_k >= 0 and (sampling.seed is None or 0 <= sampling.seed <= SEED_MAX)
        assert all(0 <= t < vocab for t in generation.stop_token_ids)
        assert isinstance(block, int) and 2 <= block <= limit

    try:
        check()
    finally:
        del engine._stream
