"""Trees while batched (core/scheduler.py, ``BatchedTarget.verify(..., trees)``): rows whose
verifier builds trees verify them in the batch's one forward, each tree as wide as the block the
chains pad to, beside rows verifying chains; each row keeps its accepted path. Every request
equals its solo plain greedy run (float32) on dense and sliding-window targets, both backends; a
commit keeping a sibling's rows breaks that; Gated DeltaNet targets verify chains while batched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.tree import GATHER  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from test_tree_engine import first_children  # noqa: E402

BACKENDS = {"torch": {"kind": "torch", "device": "cpu", "dtype": "float32"},
            "mlx": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": "off"}}
BACKEND_PARAMS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]
PROMPTS = [list(range(5, 15)), list(range(30, 52)), list(range(60, 66))]
NEW = 40  # crosses the sliding window (16)
MISTAKES = [2, 0, -1, 4, 1]  # the planted drafter's spoiled block position per cycle: branches recover them
TREE = {"kind": "tree", "options": {"budget": 12, "width": 2}}


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return tiny_targets


def engine_for(path, backend: str, script=(), verifier=TREE):
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    drafter = {"kind": "planted", "options": {"script": [list(s) for s in script], "mistakes": MISTAKES},
               "block_size": 8}
    config = {"backend": BACKENDS[backend], "target": {"path": str(path)}, "drafter": drafter}
    if verifier is not None:
        config["verifier"] = verifier
    engine = load_engine(config, registry=registry_with_planted())
    engine.batch_plan.enabled = False  # every row drafts its full width: the planted mistakes stay
    return engine


def plain_runs(path, backend: str) -> list[list[int]]:
    engine = load_engine({"backend": BACKENDS[backend], "target": {"path": str(path)}})
    return [engine.run(prompt_ids=p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS]


def batched(engine) -> list:
    return engine.run_many(prompt_ids=PROMPTS, max_new_tokens=NEW, ignore_eos=True, max_batch=len(PROMPTS))


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_batched_rows_verify_trees_and_equal_their_solo_runs(targets, name, backend):
    path = targets(name)
    plain = plain_runs(path, backend)
    engine = engine_for(path, backend, script=zip(PROMPTS, plain))
    results = batched(engine)
    assert [r.token_ids for r in results] == plain
    records = [r.stats.verifier for r in results]
    assert all(r.stats.batched_cycles > 0 and record["trees"] > 0 for r, record in zip(results, records)), records
    assert sum(sum(record["branch_used_per_depth"]) for record in records) > 0  # accepted paths left the chain
    # no tree wider than the block the chains pad to (8 tokens: the root and 7 drafts), budget 12 or not
    assert all(record["nodes_verified"] <= 8 * record["trees"] for record in records), records
    chains = batched(engine_for(path, backend, script=zip(PROMPTS, plain), verifier=None))
    assert [r.token_ids for r in chains] == plain
    assert sum(r.stats.verify_steps for r in results) < sum(r.stats.verify_steps for r in chains)  # branches paid


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_batched_commit_that_keeps_a_siblings_rows_breaks_greedy_identity(targets, backend, monkeypatch):
    path = targets("gemma3_text")
    plain = plain_runs(path, backend)
    monkeypatch.setattr(GATHER, "keep", first_children)
    results = batched(engine_for(path, backend, script=zip(PROMPTS, plain)))
    assert [r.token_ids for r in results] != plain


def test_gated_deltanet_rows_verify_chains_while_batched(targets):
    path = targets("qwen3_5")
    plain = plain_runs(path, "torch")
    engine = engine_for(path, "torch", script=zip(PROMPTS, plain))
    assert "Gated DeltaNet" in engine.target.new_batch().tree_problem()
    results = batched(engine)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.batched_cycles > 0 and r.stats.verifier["trees"] == 0 for r in results)
