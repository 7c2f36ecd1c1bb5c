"""``Drafter.propose_rows``: several sequences' DFlash / DFlash2 blocks in one draft forward.

Four prompts are each run alone through the engine with every drafter call recorded (the helpers
of test_drafter_fork.py). The recordings are then replayed into the engine's drafter and three
forks in lockstep: each row takes in its commits up to its next proposal, and the rows that
propose are asked together through ``propose_rows``. The rows sit at different context lengths
and commit different accepted counts, and draft different widths; each must propose exactly what
it proposed alone (token ids, and logits to float32 rounding), greedy and sampled (each row's
recorded rng). Every case runs on PyTorch (``torch_rows.py``) and MLX (``mlx_rows.py``)."""

from __future__ import annotations

import functools
import importlib

import pytest

torch = pytest.importorskip("torch")

from speculant.core.interfaces import Drafter  # noqa: E402
from speculant.drafters.dflash import torch_rows, visibility  # noqa: E402
from speculant.testing.tiny import build_tiny_dflash  # noqa: E402
from test_drafter_fork import BACKENDS, HAS_MLX, load, model_drafter, pairs, proposed, same, solo  # noqa: E402,F401
from row_replay import replay_rounds  # noqa: E402

ROWS = {"torch": torch_rows, "mlx": importlib.import_module("speculant.drafters.dflash.mlx_rows") if HAS_MLX else None}
PROMPTS = [[5, 6, 7, 8, 9] * 6, [40, 41, 3, 17, 90] * 3 + [8, 12], [11, 12, 13], [70, 3, 71, 4, 72, 5, 9, 9, 30, 31, 2]]


@pytest.fixture(scope="module")
def windowed(pairs, tmp_path_factory):
    """``pairs`` plus DFlash drafts with windows far shorter than the prompts: a causal sliding
    layer beside a full one, and a non-causal draft whose every layer slides (so older context
    rows are never projected, and rows start at different positions)."""
    target, drafter, prompts = pairs["dflash"]
    root = tmp_path_factory.mktemp("windows")
    mixed = build_tiny_dflash(root / "mixed", target, seed=5, block_size=8, scale=0.1, sliding_window=6,
                              extra_config={"layer_types": ["sliding_attention", "full_attention"]})
    sliding = build_tiny_dflash(root / "sliding", target, seed=6, block_size=8, scale=0.1, sliding_window=5,
                                extra_config={"is_causal": False})
    # mlx-lm's dynamic NTK RoPE takes no per-row offsets (MLX rotates its rows one by one); past 16
    # positions its base grows with the position
    dynamic = build_tiny_dflash(root / "dynamic", target, seed=8, block_size=8, scale=0.1, extra_config={
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16})
    return {**pairs, "mixed windows": (target, {**drafter, "path": str(mixed)}, prompts),
            "sliding": (target, {**drafter, "path": str(sliding)}, prompts),
            "dynamic rope": (target, {**drafter, "path": str(dynamic)}, prompts)}


def recordings(engine, prompts, sampled: bool) -> list[list[tuple]]:
    if sampled:
        engine.run = functools.partial(engine.run, temperature=0.9, seed=11)
    return [solo(engine, prompt) for prompt in prompts]


def replay_in_rows(engine, calls: list[list[tuple]], ask=None, narrower: bool = False) -> list[list[tuple]]:
    """``row_replay.replay_rounds`` through ``ask`` (default: the engine drafter's
    ``propose_rows``); ``narrower``: odd rows ask for one token fewer than they did. Returns each
    round's (row, proposed, recorded) triples."""
    ops = engine.backend.ops

    def narrow(r: int, wanted: int) -> int:
        return wanted - 1 if narrower and r % 2 and wanted > 1 else wanted

    rounds = replay_rounds(engine, calls, ask or engine.drafter.propose_rows, narrow)
    return [[(r, proposed(ops, draft), recorded) for r, draft, recorded, _ in rows] for rows in rounds]


def assert_recorded(rounds: list[list[tuple]]) -> None:
    for i, rows in enumerate(rounds):
        for r, have, want in rows:
            assert same(have, want), f"round {i} row {r}: {have[0]} != {want[0]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2", "mixed windows", "sliding", "lookup", "dynamic rope"])
def test_rows_drafted_together_equal_each_drafted_alone(windowed, kind, sampled, backend):
    if kind == "dynamic rope" and (backend == "torch" or sampled):
        pytest.skip("MLX's RoPE without per-row offsets; greedy is enough for it")
    engine, _ = load(windowed, kind, backend)
    if kind == "dynamic rope":
        assert not engine.drafter.net.model.layers[0].self_attn.rope_takes_offsets
    calls = recordings(engine, PROMPTS, sampled)
    drafted = [[p for name, _, p in c if name == "propose"] for c in calls]
    assert all(len(d) >= 3 for d in drafted) or kind == "lookup", [len(d) for d in drafted]  # lookup: copies
    rounds = replay_in_rows(engine, calls)
    assert_recorded(rounds)
    assert len(rounds) >= 3 and max(map(len, rounds)) == len(PROMPTS)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_rows_of_different_widths_each_see_their_own_block(pairs, kind, backend):
    """Odd rows ask for one token fewer than the block the others draft: each row's draft equals
    its own ``propose`` (asked one by one, Drafter's default)."""
    engine, _ = load(pairs, kind, backend)
    calls = recordings(engine, PROMPTS, sampled=False)
    together = replay_in_rows(engine, calls, narrower=True)
    alone = replay_in_rows(engine, calls, lambda ds, rs: Drafter.propose_rows(ds[0], ds, rs), narrower=True)
    assert [[r for r, _, _ in rows] for rows in together] == [[r for r, _, _ in rows] for rows in alone]
    narrowed = 0
    for i, (rows, solo_rows) in enumerate(zip(together, alone)):
        for (r, have, recorded), (_, want, _) in zip(rows, solo_rows):
            assert same(have, want), f"round {i} row {r}: {have[0]} != {want[0]}"
            narrowed += len(have[0]) < len(recorded[0])
    assert narrowed >= 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kind", "compiled"), [("dflash", False), ("dflash", True), ("dflash2", False),
                                                ("lookup", False), ("sliding", True)])
def test_one_forward_for_all_rows_also_off_a_compiled_step(windowed, monkeypatch, kind, compiled, backend):
    """Every round of two or more model drafts is one draft forward (behind prompt lookup: the
    rows left without a copy). A compiled draft step (on PyTorch traced by dynamo, run by its eager
    backend here; MLX compiles it on a CPU) drafts the first rounds one row at a time, as a request
    alone does; then its rows leave it, taking the context it holds (a ring's last window where
    every layer slides), and draft together, each as it drafted alone. The next request starts on
    the compiled step again."""
    if compiled and backend == "torch":
        monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    engine, _ = load(windowed, kind, backend, compile="auto" if compiled and backend == "mlx" else "off")
    net = model_drafter(engine.drafter).net
    if compiled and backend == "torch":
        net.compile_step(8)
    assert (net.compiled is not None) == compiled, engine.drafter.fast_path
    calls = recordings(engine, PROMPTS, sampled=False)
    forwards = []
    module = ROWS[backend]
    real = module.hidden_rows
    monkeypatch.setattr(module, "hidden_rows", lambda *a: forwards.append(len(a[0])) or real(*a))
    alone_rounds = 3 if compiled else 0  # a request drafts alone before it joins a batch

    asked = [0]

    def ask(drafters, requests):
        asked[0] += 1
        if asked[0] <= alone_rounds:
            return Drafter.propose_rows(drafters[0], drafters, requests)
        return engine.drafter.propose_rows(drafters, requests)

    rounds = replay_in_rows(engine, calls, ask)
    assert_recorded(rounds)
    modelled = [sum(have is not None and have[1] is not None for _, have, _ in rows) for rows in rounds]
    assert forwards == [n for n in modelled[alone_rounds:] if n >= 2] and max(modelled) == len(PROMPTS)
    if compiled:
        assert net.compiled is None and forwards, "the batched rows left the compiled step"
        fork = model_drafter(engine.drafter.fork())  # a new request bound while the engine's drafter is batched
        parked = model_drafter(engine.drafter).parked
        assert fork.net.compiled is not None and fork.net.compiled is not parked and fork.parked is None
        engine.run(prompt_ids=PROMPTS[0], max_new_tokens=4)
        assert net.compiled is not None, "a new request starts on the compiled step"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("broken", ["mask", "context", "positions"])
def test_a_row_reading_another_rows_context_is_caught(pairs, monkeypatch, broken, backend):
    """The check above fails when the mask lets a row see padding and other rows' slots, when
    every row is given the first row's context, or (MLX, whose RoPE takes an array of per-row
    offsets) when every row's block is rotated at the first row's position: the rows must not mix."""
    if broken == "positions" and backend == "torch":
        pytest.skip("PyTorch stacks each row's own cos/sin tables")
    engine, _ = load(pairs, "dflash", backend)
    calls = recordings(engine, PROMPTS, sampled=False)
    module = ROWS[backend]
    if broken == "mask":
        real = visibility.rows_keep
        monkeypatch.setattr(visibility, "rows_keep", lambda *a: real(*a) | True)
    elif broken == "context":
        real_init = module.PaddedRows.__init__
        monkeypatch.setattr(module.PaddedRows, "__init__",
                            lambda self, caches, layer: real_init(self, [caches[0]] * len(caches), layer))
    else:
        real_positions = module.RowPositions
        monkeypatch.setattr(module, "RowPositions", lambda first, lengths, offsets: real_positions(
            (first[0],) * len(first), lengths, offsets * 0 + first[0]))
    with pytest.raises(AssertionError, match="round"):
        assert_recorded(replay_in_rows(engine, calls))
