"""Layering rules: import-linter contracts, and the core staying free of array libraries."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mlx", "transformers", "mlx_lm")


def test_import_linter_contracts_are_kept():
    pytest.importorskip("importlinter")
    run = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()", "--no-cache"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BROKEN" not in run.stdout
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(
    "modules",
    [
        "speculant, speculant.core.engine, speculant.core.validator",
        "speculant.cli, speculant.plugins.manager, speculant.core.config",
        "speculant.api, speculant.plugin_api, speculant.drafters.lookup",
    ],
)
def test_core_imports_no_array_library(modules):
    code = (
        f"import json, sys; import {modules}; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})))"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


def test_no_module_reaches_another_speculant_module_by_a_string():
    """Imports by name hide arrows from the layers contract; only the plugin manager loads the
    modules that entry points (and ``-p``) name."""
    offenders = []
    for path in sorted((ROOT / "speculant").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name == "manager.py" and path.parent.name == "plugins":
            continue
        if re.search(r"import_module\(\s*[\"']speculant", text):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_no_module_is_over_400_lines():
    """Modules a newcomer reads top to bottom: split a module before it passes 400 lines."""
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "speculant").rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def test_the_package_graph_has_no_cycle_and_matches_docs():
    pytest.importorskip("grimp")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    edges = import_graph.package_edges()
    remaining, order = set(import_graph.PACKAGES), []
    while remaining:  # peel packages that import nothing still remaining: fails on a cycle
        leaves = {p for p in remaining if not any(a == p and b in remaining for a, b in edges)}
        assert leaves, f"import cycle among {sorted(remaining)}"
        order += sorted(leaves)
        remaining -= leaves
    assert order[0] == "speculant.core"
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert import_graph.mermaid(edges) in doc, "the import graph changed: run python scripts/import_graph.py " \
                                               "and paste it into docs/architecture.md"
