"""``speculant.plugin_api`` is all a plugin needs: the example plugins import nothing else from
speculant, and every name it exports exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import speculant.plugin_api as api
from speculant.plugins import hookspecs, manager

PLUGINS = Path(__file__).resolve().parent / "plugins"
SOURCES = sorted(PLUGINS.rglob("*.py"))


def speculant_imports(source: str) -> list[str]:
    """Every ``speculant`` module a source file imports, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [name for name in found if name == "speculant" or name.startswith("speculant.")]


def test_the_import_check_sees_every_form():
    source = ("import speculant.core.types\nfrom speculant.plugins import hookimpl\nfrom speculant import core\n"
              "def f():\n    from speculant.core.interfaces import Drafter\nfrom speculant_toy_drafter import x\n")
    assert speculant_imports(source) == ["speculant.core.types", "speculant.plugins", "speculant",
                                         "speculant.core.interfaces"]


def test_there_are_example_plugins_to_check():
    assert PLUGINS / "speculant-toy-drafter" / "speculant_toy_drafter" / "drafter.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PLUGINS)))
def test_example_plugins_import_only_the_plugin_api(path):
    others = [m for m in speculant_imports(path.read_text(encoding="utf-8")) if m != "speculant.plugin_api"]
    assert not others, f"{path.relative_to(PLUGINS)} imports {others}: plugins import from speculant.plugin_api only"


def test_every_exported_name_exists_and_hooks_share_the_marker():
    assert sorted(set(api.__all__)) == sorted(api.__all__)
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing
    assert hookspecs.hookimpl is api.hookimpl
    assert api.hookimpl.project_name == hookspecs.hookspec.project_name == api.ENTRY_POINT_GROUP
    assert manager.ENTRY_POINT_GROUP == api.ENTRY_POINT_GROUP
