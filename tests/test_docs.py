"""The reference docs follow the code: docs/configuration.md is regenerated from the config
models and compared, and docs/plugins.md documents every hook with its exact signature."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from speculant import docs_config
from speculant.core.config import BackendConfig, EngineConfig
from speculant.plugins.manager import Registry

ROOT = Path(__file__).resolve().parent.parent
UPDATE = f"run `{docs_config.COMMAND}` to update it"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return Registry().load()


# -- docs/configuration.md --------------------------------------------------------------------
def test_configuration_doc_is_up_to_date(registry):
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == docs_config.render(registry), f"docs/configuration.md is out of date: {UPDATE}"


def test_every_config_key_has_a_description(registry):
    missing = docs_config.undocumented(EngineConfig)
    for role in ("drafter", "verifier"):
        for name, plugin in docs_config._builtin(registry, role + "s").items():
            if plugin.options_model is not None:
                missing += docs_config.undocumented(plugin.options_model, f"{role}.options ({name}).")
    assert not missing, f"add a docstring (or Field(description=...)) to: {', '.join(missing)}; then {UPDATE}"


class _Changed(BackendConfig):
    kind: str = "mlx"
    """Re-defaulted."""
    threads: int = Field(2, ge=1)
    """A new key."""


class _ChangedEngine(EngineConfig):
    backend: _Changed = Field(default_factory=_Changed)
    """`[backend]`, changed."""


def test_an_added_or_re_defaulted_key_changes_the_doc(registry):
    """What the up-to-date test compares really moves with the models."""
    text = docs_config.render(registry, _ChangedEngine)
    assert text != docs_config.render(registry)
    assert '| `threads` | integer | `2` | ≥ 1 | A new key. |' in text
    assert '| `kind` | string | `"mlx"` | `mlx`, `torch` | Re-defaulted. |' in text
    assert docs_config.undocumented(_ChangedEngine) == []


def test_check_command_names_the_fix(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n")
    assert docs_config.main(["--check", "--out", str(stale)]) == 1
    assert UPDATE in capsys.readouterr().err
    assert docs_config.main(["--out", str(stale)]) == 0
    assert docs_config.main(["--check", "--out", str(stale)]) == 0
