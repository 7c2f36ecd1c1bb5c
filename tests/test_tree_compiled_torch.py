"""Draft trees over the PyTorch target's compiled path (backends/torch/static_tree.py): the tree's
mask and positions over the static cache, graphs of their own compiled at load, the accepted path
copied into place; greedy identity with plain greedy on dense and sliding-window targets, and
each rule broken on purpose breaking it; Gated DeltaNet hybrids too (their trees eager over
the static cache). Compiling takes seconds to minutes a graph on the test
CPU, so these tests are slow."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.backends.torch import static_tree  # noqa: E402
from speculant.backends.torch import target as torch_target  # noqa: E402
from speculant.core.tree import GATHER  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from speculant.testing.tiny_families import build_tiny_family  # noqa: E402

# graphs traced and functionalized, run without inductor, but for the dense tree graphs (conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.compiler("aot_eager")]

BACKEND = {"kind": "torch", "device": "cpu", "dtype": "float32"}
PROMPT = list(range(5, 15))
NEW = 48  # crosses the sliding window (16)
MISTAKES = [2, 0, -1, 4, 1]  # the planted drafter's spoiled block position per cycle
TREE = {"kind": "tree", "options": {"budget": 12, "width": 2}}


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return tiny_targets


def plain_tokens(path) -> list[int]:
    engine = load_engine({"backend": {**BACKEND, "compile": "off"}, "target": {"path": str(path)}})
    return engine.run(prompt_ids=PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids


def compiled(path, plain, verifier=TREE):
    drafter = {"kind": "planted", "options": {"script": [[PROMPT, plain]], "mistakes": MISTAKES}, "block_size": 8}
    config = {"backend": {**BACKEND, "compile": "on"}, "target": {"path": str(path)}, "drafter": drafter,
              "verifier": verifier}
    return load_engine(config, registry=registry_with_planted())


def run(engine):
    return engine.run(prompt_ids=PROMPT, max_new_tokens=NEW, ignore_eos=True)


def first_children(tree, accepted):
    """The accepted path with every node replaced by its parent's first child (the chain's node)."""
    return [0] + [min(tree.children()[tree.parents[n]].values()) for n in accepted[1:]]


# dense (one mask); Gemma 3: sliding + full layers (a mask per kind)
@pytest.mark.parametrize("name", (pytest.param("qwen3", marks=pytest.mark.compiler("inductor")), "gemma3_text"))
def test_compiled_trees_equal_plain_greedy_and_compile_nothing_per_request(targets, name, monkeypatch):
    path = targets(name)
    plain = plain_tokens(path)
    engine = compiled(path, plain)
    said = engine.target.fast_path
    assert said.startswith("compiled: widths 1, 2, 4, 8; trees 13;"), said  # budget 12: a graph of exactly 13 nodes
    first, second = run(engine), run(engine)
    for result in (first, second):
        assert result.token_ids == plain
        record = result.stats.verifier
        assert record["trees"] > 0 and "fallback" not in record and sum(record["branch_used_per_depth"]) > 0, record
    assert engine.target.fast_path.startswith("compiled: widths 1, 2, 4, 8; trees 13;"), engine.target.fast_path
    assert engine.target._steps.recompiles == 0  # trees cut short at the end ran the budget's graph
    monkeypatch.setattr(GATHER, "keep", first_children)
    assert run(engine).token_ids != plain  # a commit that keeps the chain's rows instead of the path's


def test_a_tree_mask_that_ignores_the_sliding_window_breaks_greedy_identity(targets, monkeypatch):
    path = targets("gemma3_text")
    plain = plain_tokens(path)
    full = static_tree.attention_windows
    monkeypatch.setattr(torch_target, "attention_windows", lambda config: {kind: None for kind in full(config)})
    assert run(compiled(path, plain)).token_ids != plain


@pytest.mark.parametrize("name", ("qwen3_5", "qwen3_next"))  # Gated DeltaNet 3 : 1 full attention
def test_compiled_hybrid_trees_equal_plain_greedy(tmp_path, torch_threads, name, monkeypatch):
    """A hybrid's trees run eagerly over the compiled path's static cache (chains stay compiled);
    its Gated DeltaNet record holds every node's state. Installing the state of the last path
    node's parent instead breaks identity."""
    from speculant.backends.torch.recording_static import RecordingStaticCache

    path = build_tiny_family(tmp_path / name, name)
    plain = plain_tokens(path)
    engine = compiled(path, plain)
    assert engine.target.fast_path.startswith("compiled: widths 1, 2, 4, 8;"), engine.target.fast_path
    result = run(engine)
    assert result.token_ids == plain
    record = result.stats.verifier
    assert record["trees"] > 0 and "fallback" not in record and sum(record["branch_used_per_depth"]) > 0, record
    keep_path = RecordingStaticCache.keep_path
    monkeypatch.setattr(RecordingStaticCache, "keep_path", lambda cache, rows: keep_path(cache, rows[:-1] or rows))
    broken = run(engine)
    assert broken.token_ids != plain
