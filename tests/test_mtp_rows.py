"""``MTPDrafter.propose_rows``: several sequences' MTP drafts in one step per draft depth.

Four prompts of different lengths are each run alone through the engine with every drafter call
recorded (test_drafter_fork.py's ``solo``). The recordings are replayed into the engine's drafter
and three forks in lockstep: each row takes in its commits up to its next proposal, and the rows
that propose are asked together. Rows ask for different widths (row r one token fewer per r mod
3), so rows leave the batch at different depths. Each row's draft must equal what the same row
proposes asked alone (token ids, and sampled drafts' q rows to float32 rounding), and its
recorded tokens where it asked for as many. Two MTP kinds: a Qwen3.5 hybrid target's two chained
layers, and a DeepSeek-V3 target's two MLA + mixture-of-experts layers (separate folder, for
MLX's strict loader), on PyTorch and MLX (compiled MLX steps are left for eager ones while batched).
"""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.core.interfaces import Drafter  # noqa: E402
from speculant.drafters.mtp import rows as mtp_rows, torch_rows  # noqa: E402
from speculant.testing.tiny_mtp import build_bigram_target  # noqa: E402
from speculant.testing.tiny_mtp_families import build_family_mtp  # noqa: E402
from test_drafter_fork import solo  # noqa: E402
from row_replay import replay_rounds  # noqa: E402

HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
MLX = [pytest.mark.mlx, pytest.mark.skipif(not HAS_MLX, reason="needs mlx and mlx-lm")]
BACKENDS = ["torch", pytest.param("mlx", marks=MLX)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, torch_threads):
    """name -> (target, drafter config, four prompts of different lengths)."""
    root = tmp_path_factory.mktemp("mtp_rows")
    out = {}
    hybrid, cycle = build_bigram_target(root / "qwen3_5", family="qwen3_5", hybrid=True, layer_scale=0.1)
    build_family_mtp(hybrid, num_layers=2, seed=3)
    out["qwen3_5"] = (hybrid, {"kind": "mtp", "block_size": 4}, cycle)
    deepseek, cycle = build_bigram_target(root / "deepseek_v3", family="deepseek_v3", layer_scale=0.1)
    folder = build_family_mtp(deepseek, root / "deepseek_v3_mtp", num_layers=2, seed=3)
    out["deepseek_v3"] = (deepseek, {"kind": "mtp", "block_size": 4, "path": str(folder)}, cycle)
    rng = np.random.default_rng(7)
    return {name: (target, drafter, [[int(t) for t in rng.choice(cycle + list(range(20, 60)), size=n)]
                                     for n in (40, 23, 9, 31)])
            for name, (target, drafter, cycle) in out.items()}


def load(models, name: str, backend: str, sampled: bool, compile: str = "off"):
    target, drafter, prompts = models[name]
    drafter = {**drafter, "options": {"sample_drafts": sampled}}
    engine = speculant.load_engine({"backend": {"kind": backend, "device": "cpu", "dtype": "float32", "compile": compile},
                                    "target": {"path": str(target)}, "drafter": drafter})
    if sampled:
        engine.run = functools.partial(engine.run, temperature=0.9, seed=11)
    return engine, [solo(engine, prompt) for prompt in prompts]


def drafted(ops, draft) -> tuple[list[int], np.ndarray | None]:
    probs = None if draft.draft_probs is None else np.array(ops.to_numpy(draft.draft_probs), dtype=np.float32)
    return [int(t) for t in ops.to_list(draft.token_ids)], probs


def replay_in_rows(engine, calls: list[list[tuple]], ask) -> list[list[tuple]]:
    """``row_replay.replay_rounds`` through ``ask``, row r asking r mod 3 tokens fewer (at least
    one). Returns each round's (row, drafted, recorded tokens, narrowed) tuples."""
    ops = engine.backend.ops
    rounds = replay_rounds(engine, calls, ask, lambda r, wanted: max(1, wanted - r % 3))
    return [[(r, drafted(ops, draft), recorded[0], max(1, want - r % 3) < want)
             for r, draft, recorded, want in rows] for rows in rounds]


def one_by_one(drafters, requests):
    return Drafter.propose_rows(drafters[0], drafters, requests)


def assert_rows_equal_alone(together, alone) -> None:
    assert [[r for r, *_ in rows] for rows in together] == [[r for r, *_ in rows] for rows in alone]
    for i, (rows, solo_rows) in enumerate(zip(together, alone)):
        for (r, (ids, probs), recorded, narrowed), (_, (want_ids, want_probs), _, _) in zip(rows, solo_rows):
            where = f"round {i} row {r}"
            assert ids == want_ids, f"{where}: {ids} != {want_ids}"
            assert (probs is None) == (want_probs is None), where
            if probs is not None:
                np.testing.assert_allclose(probs, want_probs, rtol=1e-5, atol=1e-6, err_msg=where)
            assert narrowed or ids == recorded, f"{where}: {ids} != recorded {recorded}"


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_drafted_together_equal_each_drafted_alone(models, backend, name, sampled):
    engine, calls = load(models, name, backend, sampled)
    together = replay_in_rows(engine, calls, engine.drafter.propose_rows)
    alone = replay_in_rows(engine, calls, one_by_one)
    assert_rows_equal_alone(together, alone)
    sizes = [len(rows) for rows in together]
    widths = {len(ids) for rows in together for _, (ids, _), _, _ in rows}
    assert all((probs is not None) == sampled for rows in together for _, (_, probs), _, _ in rows)
    assert max(sizes) == 4 and sizes.count(4) >= 3 and widths >= {1, 2, 3}, (sizes, widths)


@pytest.mark.parametrize(("backend", "compile"), [("torch", "off"), pytest.param("mlx", "off", marks=MLX),
                                                  pytest.param("mlx", "auto", marks=MLX)])
def test_one_step_per_depth_also_off_compiled_steps(models, monkeypatch, backend, compile):
    """A round of rows is one head projection then one batched step per further depth, over the
    rows still drafting; no row runs its own step. Compiled MLX steps draft the first rounds one
    row at a time, as a request alone does; then the rows leave them, taking the entries their
    buffers hold, and draft together, each as it drafted alone. The next request starts on the
    compiled steps again."""
    engine, calls = load(models, "qwen3_5", backend, sampled=False, compile=compile)
    net_type = type(engine.drafter.net)
    steps, solo_steps, asking = [], [], [False]
    real_rows, real_run = net_type.run_rows, net_type.run
    monkeypatch.setattr(net_type, "run_rows", lambda self, nets, *a: steps.append(len(nets)) or real_rows(self, nets, *a))
    monkeypatch.setattr(net_type, "run", lambda self, *a: (asking[0] and solo_steps.append(1)) or real_run(self, *a))
    alone_rounds = 3 if compile == "auto" else 0
    asked = [0]

    def ask(drafters, requests):
        asked[0] += 1
        if asked[0] <= alone_rounds:
            return one_by_one(drafters, requests)
        asking[0] = True
        try:
            return engine.drafter.propose_rows(drafters, requests)
        finally:
            asking[0] = False

    rounds = replay_in_rows(engine, calls, ask)
    for rows in rounds:
        for _, (ids, _), recorded, narrowed in rows:
            assert narrowed or ids == recorded
    widths = [sorted((len(ids) for _, (ids, _), _, _ in rows), reverse=True)
              for rows in rounds[alone_rounds:] if len(rows) > 1]
    expected = [sum(w > k for w in ws) for ws in widths for k in range(1, ws[0])]
    assert steps == expected and solo_steps == [] and len(widths) >= 3
    if compile == "auto":
        assert engine.drafter.net.compiled is None, "the batched rows left the compiled steps"
        engine.run(prompt_ids=[5, 6, 7, 8], max_new_tokens=4)
        assert engine.drafter.net.compiled is not None, "a new request starts on the compiled steps"


@pytest.mark.parametrize("broken", ["mask", "context"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_reading_another_rows_context_is_caught(models, monkeypatch, backend, broken):
    """The check above fails when the mask lets a row see padding and longer rows' slots, or when
    every row attends over the first row's cache: the rows must not mix."""
    engine, calls = load(models, "qwen3_5", backend, sampled=True)
    module = torch_rows
    if backend == "mlx":
        from speculant.drafters.mtp import mlx_rows as module
    if broken == "mask":
        real = mtp_rows.keys_kept
        monkeypatch.setattr(module, "keys_kept", lambda lengths: real(lengths) | True)
    else:
        real_init = module.RowsCache.__init__
        monkeypatch.setattr(module.RowsCache, "__init__", lambda self, caches: real_init(self, [caches[0]] * len(caches)))
    together = replay_in_rows(engine, calls, engine.drafter.propose_rows)
    alone = replay_in_rows(engine, calls, one_by_one)
    with pytest.raises(AssertionError, match="round"):
        assert_rows_equal_alone(together, alone)


def test_rows_leave_the_batch_at_their_own_width():
    assert mtp_rows.active_rows([3, 1, 2, 3], 1) == [0, 2, 3]
    assert mtp_rows.active_rows([3, 1, 2, 3], 2) == [0, 3]
    assert mtp_rows.keys_kept([2, 4])[:, 0, 0].tolist() == [[True, True, False, False], [True] * 4]
