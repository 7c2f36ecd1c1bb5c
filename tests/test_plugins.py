"""Plugins for real: fixture packages under tests/plugins/ are pip-installed into a temporary
folder and discovered through their entry points, exactly as a user's installed plugin is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.core.errors import ValidationFailed
from speculant.plugins import Registry, hookimpl

HERE = Path(__file__).resolve().parent
FIXTURES = ("speculant-toy-drafter", "speculant-broken-plugin", "speculant-dup-plugin")
FIXTURE_MODULES = ("speculant_toy_drafter", "speculant_broken_plugin", "speculant_dup_plugin")


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """pip-install the three fixture projects (no network, no isolation) into one --target folder."""
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.skip("building the fixture plugins needs setuptools>=70.1 (pip install 'speculant[dev]')")
    root = tmp_path_factory.mktemp("plugins")
    sources = []
    for name in FIXTURES:  # build from copies so the source tree stays clean
        shutil.copytree(HERE / "plugins" / name, root / "src" / name,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        sources.append(str(root / "src" / name))
    site = root / "site"
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(site), *sources],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return site


@pytest.fixture
def installed(plugin_site, monkeypatch):
    """The fixture plugins are importable and discoverable for this test only."""
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv("SPECULANT_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("SPECULANT_DISABLE_PLUGINS", raising=False)
    yield plugin_site
    for module in list(sys.modules):
        if module.split(".")[0] in FIXTURE_MODULES:
            del sys.modules[module]


def record(registry: Registry, name: str):
    matches = [p for p in registry.plugins if p.name == name]
    assert len(matches) == 1, [p.name for p in registry.plugins]
    return matches[0]


def subprocess_env(site: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECULANT_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"  # tiny models: one thread is fastest, and far faster on a busy machine
    env.update(extra)
    return env


# -- discovery --------------------------------------------------------------------------------
def test_pip_wrote_real_entry_point_metadata(plugin_site):
    text = (plugin_site / "speculant_toy_drafter-0.1.dist-info" / "entry_points.txt").read_text()
    assert "[speculant]" in text and "toy = speculant_toy_drafter" in text


def test_toy_drafter_is_discovered_with_its_origin(installed):
    registry = Registry().load()
    toy = record(registry, "toy")
    assert (toy.status, toy.distribution, toy.version) == ("loaded", "speculant-toy-drafter", "0.1")
    assert toy.hooks == ["register_drafters"] and toy.registered == {"drafters": ["toy"]}
    assert toy.location.startswith(str(installed))
    assert registry.origin("drafters", "toy") == "speculant-toy-drafter 0.1"
    assert registry.drafters["toy"].backends == ("torch", "mlx")
    assert registry.origin("drafters", "dflash") == "builtin (dflash)"


def test_broken_plugin_is_reported_and_the_rest_still_work(installed):
    registry = Registry().load()
    broken = record(registry, "broken")
    assert broken.status == "failed" and broken.distribution == "speculant-broken-plugin"
    assert "RuntimeError" in broken.error and "cannot be imported (on purpose)" in broken.error
    assert "speculant_broken_plugin.py" in broken.traceback and "Traceback" in broken.traceback
    assert registry.failed_plugins() == [p for p in registry.plugins if p.name in ("broken", "dup", "mlx") and p.status == "failed"]
    assert {"toy", "dflash"} <= set(registry.drafters) and "torch" in registry.backends
    assert {"greedy", "speculative_sampling"} <= set(registry.verifiers)


def test_asking_for_a_broken_plugins_drafter_names_the_failure(installed, tiny_target):
    config = {"target": {"path": str(tiny_target)}, "drafter": {"kind": "broken"}}
    with pytest.raises(ValidationFailed) as err:
        import speculant

        speculant.load_engine(config, registry=Registry().load())
    text = str(err.value)
    assert "no drafter named 'broken'" in text
    assert "speculant-broken-plugin 0.1 (RuntimeError" in text


def test_duplicate_name_names_both_sources_and_takes_everything_back(installed):
    registry = Registry().load()
    dup = record(registry, "dup")
    assert dup.status == "failed"
    assert "duplicate verifier name 'greedy'" in dup.error
    assert "builtin (verifiers)" in dup.error and "speculant-dup-plugin 0.1" in dup.error
    assert registry.origin("verifiers", "greedy") == "builtin (verifiers)"
    assert registry.verifiers["greedy"].__module__ == "speculant.verifiers.greedy"
    assert "dup_only" not in registry.verifiers  # registered before the clash, then taken back
    assert dup.registered == {} and not registry.pm.has_plugin(dup.key)


def test_fresh_registries_share_no_state(installed):
    first, second = Registry().load(), Registry().load()
    first.drafters.pop("toy")
    assert "toy" in second.drafters
    assert first.pm is not second.pm


# -- SPECULANT_LOAD_PLUGINS / SPECULANT_DISABLE_PLUGINS ---------------------------------------
def statuses(registry: Registry) -> dict[str, str]:
    return {p.name: p.status for p in registry.plugins if p.name in ("toy", "broken", "dup")}


def test_empty_allow_list_loads_only_builtins(installed, monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")
    registry = Registry().load()
    assert statuses(registry) == {"toy": "blocked", "broken": "blocked", "dup": "blocked"}
    assert "toy" not in registry.drafters and "dflash" in registry.drafters
    assert "blocked plugins" in registry.missing_hint("drafters", "toy")
    assert "speculant_toy_drafter" not in sys.modules  # a blocked plugin's code never runs


@pytest.mark.parametrize("allow", ["speculant-toy-drafter", "toy", " toy , nothing-else "])
def test_allow_list_by_distribution_or_entry_point_name(installed, monkeypatch, allow):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", allow)
    registry = Registry().load()
    assert statuses(registry) == {"toy": "loaded", "broken": "blocked", "dup": "blocked"}
    assert "toy" in registry.drafters and not [p for p in registry.failed_plugins() if p.name != "mlx"]


def test_block_list(installed, monkeypatch):
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "broken,speculant-dup-plugin")
    registry = Registry().load()
    assert statuses(registry) == {"toy": "loaded", "broken": "blocked", "dup": "blocked"}


def test_block_list_wins_over_allow_list(installed, monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "toy,broken")
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "toy")
    assert statuses(Registry().load()) == {"toy": "blocked", "broken": "failed", "dup": "blocked"}


def test_builtins_are_never_blocked(installed, monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")
    monkeypatch.setenv("SPECULANT_DISABLE_PLUGINS", "verifiers,dflash,speculant")
    registry = Registry().load()
    assert "greedy" in registry.verifiers and "dflash" in registry.drafters


def test_builtin_fallback_matches_the_declared_entry_points():
    """BUILTIN_PLUGINS (used from an uninstalled source tree) lists exactly pyproject's entry points."""
    from speculant.core.config import tomllib
    from speculant.plugins.manager import BUILTIN_PLUGINS

    declared = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["entry-points"]["speculant"]
    assert dict(BUILTIN_PLUGINS) == declared


def test_builtins_load_without_entry_point_metadata(monkeypatch):
    """From a source tree that was never pip-installed, the fallback tuple still loads every built-in."""
    from speculant.plugins import manager

    monkeypatch.setattr(manager, "_entry_points", lambda: [])
    registry = Registry().load()
    assert [(p.name, p.distribution) for p in registry.plugins] == [(n, "builtin") for n, _ in manager.BUILTIN_PLUGINS]
    assert "dflash" in registry.drafters and "torch" in registry.backends and "greedy" in registry.verifiers


# -- in-process plugins and hook validation ---------------------------------------------------
def test_misspelled_hook_fails_the_plugin(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")

    class Typo:
        @hookimpl
        def register_drafter(self, register):  # missing "s"
            raise AssertionError("never called")

    registry = Registry().load()
    rec = registry.add_plugin(Typo(), "typo")
    assert rec.status == "failed" and "register_drafter" in rec.error
    assert not registry.pm.has_plugin(rec.key)


def test_registering_an_object_without_a_name_fails(monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")

    class Nameless:
        @hookimpl
        def register_verifiers(self, register):
            register(object())

    rec = Registry().load().add_plugin(Nameless(), "nameless")
    assert rec.status == "failed" and "without a string `name`" in rec.error


def test_extra_module_loads_like_a_plugin(installed, monkeypatch):
    monkeypatch.setenv("SPECULANT_LOAD_PLUGINS", "")  # the entry point is blocked, -p still loads it
    registry = Registry().load(extra_modules=("speculant_toy_drafter",))
    rec = record(registry, "speculant_toy_drafter")
    assert rec.distribution == "command line" and rec.status == "loaded"
    assert registry.origin("drafters", "toy") == "command line (speculant_toy_drafter)"


# -- the CLI sees them ------------------------------------------------------------------------
def run_cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speculant", *args], capture_output=True, text=True,
                          env=subprocess_env(site, **env), timeout=300)


def test_plugins_json_in_a_subprocess(plugin_site):
    run = run_cli(plugin_site, "plugins", "--json")
    assert run.returncode == 0, run.stderr
    rows = {row["name"]: row for row in json.loads(run.stdout)}
    assert rows["toy"]["status"] == "loaded" and rows["toy"]["distribution"] == "speculant-toy-drafter"
    assert rows["toy"]["version"] == "0.1" and rows["toy"]["registered"] == {"drafters": ["toy"]}
    assert rows["toy"]["hooks"] == ["register_drafters"]
    assert rows["broken"]["status"] == "failed" and "on purpose" in rows["broken"]["error"]
    assert "Traceback" in rows["broken"]["traceback"]
    assert rows["dup"]["status"] == "failed" and "builtin (verifiers)" in rows["dup"]["error"]
    assert rows["verifiers"]["distribution"] == "builtin"
    assert {"name", "distribution", "version", "location", "hooks", "registered", "status", "error"} <= set(rows["toy"])

    blocked = {row["name"]: row["status"] for row in json.loads(run_cli(plugin_site, "plugins", "--json",
                                                                          SPECULANT_LOAD_PLUGINS="").stdout)}
    assert blocked["toy"] == blocked["broken"] == "blocked"


def test_plugins_table_traceback_and_check(plugin_site):
    run = run_cli(plugin_site, "plugins", "--traceback", "--check")
    assert run.returncode == 1  # --check: something failed
    assert "toy (speculant-toy-drafter 0.1): loaded" in run.stdout
    assert "drafters: toy" in run.stdout
    assert "broken (speculant-broken-plugin 0.1): failed: RuntimeError" in run.stdout
    assert "Traceback (most recent call last)" in run.stdout
    quiet = run_cli(plugin_site, "plugins")
    assert quiet.returncode == 0 and "Traceback" not in quiet.stdout


# -- the toy drafter generates, losslessly ----------------------------------------------------
def toy_config(target: Path, **drafter) -> dict:
    return {
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
        "target": {"path": str(target)},
        "drafter": {"kind": "toy", **drafter},
    }


def test_toy_drafter_reproduces_plain_greedy_output(installed, tiny_target):
    import speculant

    registry = Registry().load()
    plain = speculant.load_engine(toy_config(tiny_target, kind="none"), registry=registry)
    toy = speculant.load_engine(toy_config(tiny_target, block_size=7), registry=registry)
    accepted = []
    for prompt in ([5], [5, 6, 7, 5, 6], list(range(20, 40))):
        expected = plain.run(prompt_ids=prompt, max_new_tokens=40, ignore_eos=True)
        for block_size in (2, 4, 7):
            result = toy.run(prompt_ids=prompt, max_new_tokens=40, ignore_eos=True, block_size=block_size)
            assert result.token_ids == expected.token_ids, (prompt, block_size)
            assert result.text == expected.text
            stats = result.stats
            assert stats.new_tokens == 40 == 1 + sum(stats.acceptance_lengths)
            assert all(1 <= a <= block_size for a in stats.acceptance_lengths)
            accepted.extend(stats.acceptance_lengths)
    assert max(accepted) > 1  # prompt lookup on repetitive greedy output: some drafts were really accepted


def test_toy_drafter_from_a_config_file(installed, tiny_target, tmp_path):
    import speculant

    (tmp_path / "engine.toml").write_text(
        f'[backend]\nkind = "torch"\ndevice = "cpu"\ndtype = "float32"\n\n[target]\npath = {json.dumps(str(tiny_target))}\n\n'
        '[drafter]\nkind = "toy"\nblock_size = 5\n\n[drafter.options]\nngram_max = 2\n\n[generation]\nmax_new_tokens = 24\nignore_eos = true\n'
    )
    registry = Registry().load()
    engine = speculant.load_engine(tmp_path / "engine.toml", registry=registry)
    assert engine.drafter.options.ngram_max == 2 and engine.block_size == 5
    plain = speculant.load_engine(toy_config(tiny_target, kind="none"), registry=registry)
    assert engine.run("def add(a, b):").token_ids == plain.run("def add(a, b):", max_new_tokens=24, ignore_eos=True).token_ids


def test_toy_drafter_options_are_validated(installed, tiny_target):
    from speculant.api import validate

    report = validate(toy_config(tiny_target, options={"ngram": 2}), Registry().load())
    assert [p.field for p in report.errors] == ["drafter.options"] and "ngram" in report.errors[0].message


def test_cli_generate_with_the_toy_drafter(plugin_site, tiny_target):
    import speculant

    toy = run_cli(plugin_site, "generate", "--target", str(tiny_target), "--device", "cpu", "--dtype", "float32",
                  "--max-new-tokens", "24", "--json", "--drafter", "toy", "--block-size", "4", "def add(a, b):")
    assert toy.returncode == 0, toy.stderr
    plain = speculant.load_engine(toy_config(tiny_target, kind="none")).run("def add(a, b):", max_new_tokens=24)
    assert toy.stdout == plain.text and toy.stdout
    stats = json.loads(toy.stderr.strip().splitlines()[-1])
    assert stats["verify_steps"] == len(stats["acceptance_lengths"]) > 0
    assert stats["new_tokens"] == plain.stats.new_tokens


def test_warnings_are_printed_but_do_not_fail(installed, tiny_target, tmp_path, capsys):
    from speculant.cli import main

    common = ["--target", str(tiny_target), "--drafter", "toy", "--draft", str(tmp_path), "--device", "cpu",
              "--dtype", "float32", "--max-new-tokens", "4", "hi"]
    assert main(["generate", *common]) == 0
    err = capsys.readouterr().err
    assert "speculant: warning: drafter.path: the toy drafter reads no checkpoint" in err
    (tmp_path / "engine.toml").write_text(
        f'[target]\npath = {json.dumps(str(tiny_target))}\n[drafter]\nkind = "toy"\npath = "."\n')
    assert main(["validate", str(tmp_path / "engine.toml")]) == 0
    out = capsys.readouterr().out
    assert "warning: drafter.path:" in out and "0 error(s), 1 warning(s)" in out


def test_draft_quantization_checks_are_a_plugin_of_their_own():
    """They register through their own entry point, not as a side effect of importing the dflash
    plugin, so the checks run for every drafter and only once."""
    import tomllib

    records = {p.name: p for p in Registry().load().plugins}
    quantization = records["quantization"]
    assert quantization.status == "loaded" and quantization.module == "speculant.drafters.quantization"
    assert quantization.hooks == ["check_pairing"] and "check_pairing" not in records["dflash"].hooks
    points = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["entry-points"]
    assert points["speculant"]["quantization"] == "speculant.drafters.quantization"
