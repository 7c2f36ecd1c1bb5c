"""The reference docs follow the code: docs/configuration.md is regenerated from the config
models and compared, and docs/plugins.md documents every hook with its exact signature."""

from __future__ import annotations

import ast
import re
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
    if docs_config.failed_builtins(registry):  # e.g. no mlx here: its names would be missing
        pytest.skip(f"built-in plugins did not load: {docs_config.failed_builtins(registry)}")
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
    assert re.search(r'^\| `kind` \| string \| `"mlx"` \| .*`torch`.* \| Re-defaulted\. \|$', text, flags=re.M)
    assert docs_config.undocumented(_ChangedEngine) == []


def test_check_command_names_the_fix(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n")
    assert docs_config.main(["--check", "--out", str(stale)]) == 1
    assert UPDATE in capsys.readouterr().err
    assert docs_config.main(["--out", str(stale)]) == 0
    assert docs_config.main(["--check", "--out", str(stale)]) == 0


# -- docs/plugins.md --------------------------------------------------------------------------
PLUGINS_DOC = ROOT / "docs" / "plugins.md"
HOOKSPECS = ROOT / "speculant" / "plugins" / "hookspecs.py"
EXAMPLES = ROOT / "tests" / "plugins"


def hook_signatures(source: str) -> dict[str, str]:
    """``{hook: "name(arguments)"}`` for every ``@hookspec`` function of a hookspecs module."""
    signatures = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and any(ast.unparse(d).startswith("hookspec") for d in node.decorator_list):
            signatures[node.name] = f"{node.name}({ast.unparse(node.args)})"
    return signatures


def undocumented_hooks(source: str, doc: str) -> list[str]:
    """Hook signatures without a ``### `signature` `` heading in ``doc``."""
    headings = set(re.findall(r"^### `(.+)`$", doc, flags=re.M))
    return [sig for sig in hook_signatures(source).values() if sig not in headings]


def test_every_hook_is_documented_with_its_exact_signature():
    source, doc = HOOKSPECS.read_text(encoding="utf-8"), PLUGINS_DOC.read_text(encoding="utf-8")
    assert len(hook_signatures(source)) >= 4
    missing = undocumented_hooks(source, doc)
    assert not missing, f"document these hooks in docs/plugins.md under a '### `signature`' heading: {missing}"
    stale = [h for h in re.findall(r"^### `(\w+)\(", doc, flags=re.M) if h not in hook_signatures(source)]
    assert not stale, f"docs/plugins.md documents hooks that hookspecs.py no longer has: {stale}"


def test_a_new_hook_or_a_changed_argument_is_caught():
    source, doc = HOOKSPECS.read_text(encoding="utf-8"), PLUGINS_DOC.read_text(encoding="utf-8")
    changed = source.replace("def check_pairing(config, target, drafter):", "def check_pairing(config, target, drafter, backend):")
    assert changed != source
    added = source + "\n\n@hookspec\ndef register_tokenizers(register):\n    \"\"\"New.\"\"\"\n"
    assert undocumented_hooks(changed, doc) == ["check_pairing(config, target, drafter, backend)"]
    assert undocumented_hooks(added, doc) == ["register_tokenizers(register)"]


def code_excerpts(doc: str) -> list[tuple[str, str]]:
    """``(path, code)`` for each fenced block of ``doc`` whose first line is ``# <path>``."""
    blocks = re.findall(r"^```\w*\n# (\S+)\n(.*?)^```$", doc, flags=re.M | re.S)
    return [(path, code) for path, code in blocks]


def test_worked_example_excerpts_match_the_example_plugin():
    excerpts = code_excerpts(PLUGINS_DOC.read_text(encoding="utf-8"))
    assert len(excerpts) >= 5
    for path, code in excerpts:
        files = [f for f in EXAMPLES.rglob("*") if f.as_posix().endswith("/" + path)]
        assert len(files) == 1, f"docs/plugins.md quotes {path}, which is not one file under tests/plugins"
        assert code in files[0].read_text(encoding="utf-8"), f"docs/plugins.md's excerpt of {path} no longer matches it"


# -- links --------------------------------------------------------------------------------------
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS = PAGES[2:]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def local_links(page: Path) -> list[tuple[Path, str]]:
    """``(target file, anchor)`` for every relative link of ``page``."""
    links = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"\w+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        links.append(((page.parent / path).resolve() if path else page, anchor))
    return links


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
    assert len(DOCS) >= 10
    linked = {target for page in PAGES for target, _ in local_links(page) if target != page}
    orphans = [p.name for p in DOCS if p.resolve() not in linked]
    assert not orphans, f"link these from README.md, CONTRIBUTING.md or another docs page: {orphans}"


def test_local_links_resolve():
    broken = []
    for page in PAGES:
        for target, anchor in local_links(page):
            if not target.exists():
                broken.append(f"{page.name} -> {target.relative_to(ROOT)}")
            elif anchor and target.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    broken.append(f"{page.name} -> {target.name}#{anchor}")
    assert not broken, broken


def test_the_link_checks_can_fail(tmp_path):
    assert slug("`drafter.options`") == "drafteroptions" and slug("## `[backend]`".lstrip("# ")) == "backend"
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](https://example.com/x.md) [c](#here)\n")
    assert local_links(page) == [(tmp_path / "missing.md", ""), (page, "here")]
