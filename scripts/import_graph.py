"""Print speculant's package-level import graph as a mermaid flowchart (docs/architecture.md).

Every import counts, lazy ones inside functions included (grimp reads them all). Run:
``python scripts/import_graph.py`` and paste the output into docs/architecture.md; the test in
tests/test_architecture.py fails when the two differ or when the graph has a cycle.
"""

from __future__ import annotations

import grimp

PACKAGES = (
    "speculant.cli", "speculant.cli_settings", "speculant.chat", "speculant.check", "speculant.serve", "speculant.bench",
    "speculant.training", "speculant.testing", "speculant.embedded", "speculant.pairs", "speculant.api", "speculant.plugins",
    "speculant.backends", "speculant.drafters", "speculant.verifiers", "speculant.plugin_api", "speculant.core",
)


def package_of(module: str) -> str | None:
    for package in sorted(PACKAGES, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return None


def package_edges() -> set[tuple[str, str]]:
    graph = grimp.build_graph("speculant")
    edges = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            a, b = package_of(module), package_of(imported)
            if a and b and a != b:
                edges.add((a, b))
    return edges


def mermaid(edges: set[tuple[str, str]]) -> str:
    short = {p: p.removeprefix("speculant.") for p in PACKAGES}
    lines = ["flowchart TD"]
    lines += [f"    {short[a]} --> {short[b]}" for a, b in sorted(edges, key=lambda e: (PACKAGES.index(e[0]), PACKAGES.index(e[1])))]
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid(package_edges()))
