"""``Drafter.fork``: one drafter per live sequence over shared weights (issue #39's batching).

Each prompt is first run alone through the engine while every call the engine makes to its
drafter is recorded (the target's outputs copied as they were). The two recordings are then
replayed call by call into the original drafter and a fork of it, interleaved (prefill A, prefill
B, propose A, propose B, commit A, ...): each must propose exactly what it proposed alone. A fork
that shared any per-sequence state (a context cache, queued rows, a token history, compiled
buffers) proposes after the other sequence's context and fails.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from typing import Sequence

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.core.interfaces import Drafter  # noqa: E402
from speculant.testing.tiny import build_tiny_dflash, build_tiny_target, plant_checkpoint  # noqa: E402
from speculant.testing.tiny_dflash2 import build_tiny_dflash2  # noqa: E402
from speculant.testing.tiny_mtp import build_bigram_target  # noqa: E402
from speculant.testing.tiny_mtp_families import build_family_mtp  # noqa: E402

NEW = 40
HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
MLX = [pytest.mark.mlx, pytest.mark.skipif(not HAS_MLX, reason="needs mlx and mlx-lm")]
BACKENDS = ["torch", pytest.param("mlx", marks=MLX)]
# (backend, backend.compile): MLX compiles the draft steps on a CPU (auto), and eager with "off"
RUNS = [("torch", "off"), pytest.param("mlx", "auto", marks=MLX), pytest.param("mlx", "off", marks=MLX)]
KINDS = ["dflash", "dflash2", "mtp", "lookup"]
RECORDED = ("prefill", "propose_free", "propose_beside", "propose", "commit", "propose_ahead", "withdraw_ahead")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, torch_threads):
    """(target, drafter config, two prompts) per drafter kind. The DFlash target follows its
    planted token part of the time: blocks accepted whole, partly and not at all."""
    root = tmp_path_factory.mktemp("fork")
    target = build_tiny_target(root / "target", seed=0)
    plant_checkpoint(target, strength=1.0, soften=0.2)
    dflash = str(build_tiny_dflash(root / "d1", target, seed=7, block_size=8, scale=0.1))
    dflash2 = str(build_tiny_dflash2(root / "d2", target, seed=7, block_size=8))
    mtp_target, cycle = build_bigram_target(root / "mtp", family="qwen3_5", hybrid=True, layer_scale=0.1)
    build_family_mtp(mtp_target, num_layers=2, seed=3)
    rng = np.random.default_rng(7)
    mtp_prompts = [[int(t) for t in rng.choice(cycle + list(range(20, 60)), size=n)] for n in (40, 23)]
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 3, 17, 90] * 3 + [8, 12]]
    return {
        "dflash": (target, {"kind": "dflash", "path": dflash, "block_size": 8}, prompts),
        "dflash2": (target, {"kind": "dflash2", "path": dflash2, "block_size": 8}, prompts),
        "mtp": (mtp_target, {"kind": "mtp", "block_size": 3}, mtp_prompts),
        "lookup": (target, {"kind": "dflash", "path": dflash, "block_size": 6,
                            "lookup": {"enabled": True, "min_match": 2, "max_match": 3}}, prompts),
    }


def load(pairs, kind: str, backend: str, compile: str = "off", ahead: str = "off"):
    target, drafter, prompts = pairs[kind]
    config = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32", "compile": compile,
                          "draft_ahead": ahead},
              "target": {"path": str(target)}, "drafter": drafter}
    return speculant.load_engine(config), prompts


def proposed(ops, draft) -> tuple[list[int], np.ndarray | None] | None:
    """A draft's token ids and (when it has them) its logits, on the host."""
    if draft is None:
        return None
    logits = None if draft.logits is None else np.array(ops.to_numpy(draft.logits), dtype=np.float32)
    return [int(t) for t in ops.to_list(draft.token_ids)], logits


def solo(engine, prompt: Sequence[int]) -> list[tuple]:
    """Every drafter call of one request run alone: (method, copied arguments, what it proposed)."""
    drafter, calls, depth = engine.drafter, [], [0]

    def recording(name, method):
        def call(*args):
            kept = copy.deepcopy(args)  # a target may reuse its output buffers
            depth[0] += 1
            try:
                result = method(*args)
            finally:
                depth[0] -= 1
            if not depth[0]:  # the engine's calls only (propose_ahead commits through self.commit)
                calls.append((name, kept, proposed(engine.backend.ops, result) if name.startswith("propose") else None))
            return result
        return call

    for name in RECORDED:
        setattr(drafter, name, recording(name, getattr(drafter, name)))
    try:
        engine.run(prompt_ids=list(prompt), max_new_tokens=NEW, ignore_eos=True)
    finally:
        for name in RECORDED:
            delattr(drafter, name)
    return calls


def replay(ops, drafter: Drafter, call):
    name, args, _ = call
    result = getattr(drafter, name)(*copy.deepcopy(args))
    return proposed(ops, result) if name.startswith("propose") else None


def interleaved(engine, calls_a, calls_b) -> tuple[list, list]:
    """Replay A on the engine's drafter and B on a fork made once A is prefilled, call by call."""
    ops, original = engine.backend.ops, engine.drafter
    got_a, got_b = [replay(ops, original, calls_a[0])], []
    fork = original.fork()
    for i in range(max(len(calls_a), len(calls_b))):
        if i < len(calls_b):
            got_b.append(replay(ops, fork, calls_b[i]))
        if 0 < i < len(calls_a):
            got_a.append(replay(ops, original, calls_a[i]))
    return got_a, got_b


def proposals(calls) -> list:
    return [result for _, _, result in calls]


def same(a, b) -> bool:
    """Whether two calls' proposals agree: the same tokens, logits equal to float32 rounding."""
    if a is None or b is None:
        return a is b
    (ids_a, logits_a), (ids_b, logits_b) = a, b
    if logits_a is None or logits_b is None:
        return ids_a == ids_b and logits_a is logits_b
    return ids_a == ids_b and logits_a.shape == logits_b.shape and np.allclose(logits_a, logits_b, rtol=1e-5, atol=1e-5)


def assert_same(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert same(a, b), f"call {i}: {a} != {b}"


def check_interleaved_equals_solo(engine, prompts) -> None:
    calls = [solo(engine, prompt) for prompt in prompts]
    drafted = [[p for p in proposals(c) if p is not None] for c in calls]
    assert all(len(d) >= 4 for d in drafted), drafted  # both requests drafted every few cycles
    # a drafter mixing up the two contexts proposes something else
    assert len(drafted[0]) != len(drafted[1]) or not all(same(a, b) for a, b in zip(*drafted))
    got_a, got_b = interleaved(engine, *calls)
    assert_same(got_a, proposals(calls[0]))
    assert_same(got_b, proposals(calls[1]))


@pytest.mark.parametrize(("backend", "compile"), RUNS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fork_and_its_original_draft_interleaved_as_each_alone(pairs, kind, backend, compile):
    engine, prompts = load(pairs, kind, backend, compile)
    compiled = getattr(model_drafter(engine.drafter).net, "compiled", None)
    assert (compiled is not None) == (compile == "auto"), engine.drafter.fast_path
    check_interleaved_equals_solo(engine, prompts)
    assert type(engine.drafter.fork()) is type(engine.drafter)


@pytest.mark.parametrize("backend", BACKENDS)
def test_forks_draft_ahead_and_withdraw_as_each_alone(pairs, backend):
    """DFlash drafts made ahead (kept when a block is accepted whole, withdrawn otherwise) and
    withdrawn in a fork leave the other sequence's context as it was."""
    engine, prompts = load(pairs, "dflash", backend, compile="off", ahead="on")
    calls = [solo(engine, prompt) for prompt in prompts]
    made = [[name for name, _, _ in c] for c in calls]
    assert all("propose_ahead" in m for m in made) and any("withdraw_ahead" in m for m in made), [set(m) for m in made]
    got_a, got_b = interleaved(engine, *calls)
    assert_same(got_a, proposals(calls[0]))
    assert_same(got_b, proposals(calls[1]))


def model_drafter(drafter):
    return getattr(drafter, "inner", None) or drafter


def parameters(model) -> list:
    if hasattr(model, "named_parameters"):
        return [p for _, p in model.named_parameters()]
    from mlx.utils import tree_flatten

    return [p for _, p in tree_flatten(model.parameters())]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fork_shares_the_weights_and_compiled_code_not_the_state(pairs, kind, backend):
    engine, _ = load(pairs, kind, backend, compile="auto")
    original, fork = engine.drafter, engine.drafter.fork()
    if kind == "lookup":
        assert fork.index is not original.index and fork.inner is not original.inner
    original, fork = model_drafter(original), model_drafter(fork)
    assert fork is not original and fork.net is not original.net
    assert fork.net.model is original.net.model and fork.net.target is original.net.target
    assert all(a is b for a, b in zip(parameters(fork.net.model), parameters(original.net.model), strict=True))
    own = ("caches",) if kind == "mtp" else ("cache",)
    assert all(getattr(fork.net, name) is not getattr(original.net, name) for name in own)
    compiled = getattr(original.net, "compiled", None)
    if backend == "mlx":
        assert compiled is not None, original.fast_path  # MLX compiles the draft step on a CPU too
    if compiled is not None:
        code = "_graphs" if backend == "torch" else "_compiled"
        assert fork.net.compiled is not compiled
        assert getattr(fork.net.compiled, code) is getattr(compiled, code)
    assert fork.fast_path == original.fast_path


@pytest.mark.parametrize(("kind", "compiler"), [("dflash", "eager"), ("dflash2", "eager"),
                                                pytest.param("dflash", "aot_eager", marks=pytest.mark.slow)])
def test_forks_share_the_compiled_torch_draft_graphs(pairs, kind, compiler, monkeypatch):
    """The compiled draft step (dflash/compiled.py), traced by dynamo and run by its eager backend,
    or functionalized by AOTAutograd too (inductor's draft graphs: test_fast_path_torch.py): forks
    keep buffers of their own, run the original's graphs, and compile nothing more."""
    engine, prompts = load(pairs, kind, "torch")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=compiler))
    engine.drafter.net.compile_step(8)
    draft = engine.drafter.net.compiled
    assert draft is not None, engine.drafter.fast_path
    calls = [solo(engine, prompt) for prompt in prompts]
    graphs = set(draft._graphs)
    got_a, got_b = interleaved(engine, *calls)
    assert_same(got_a, proposals(calls[0]))
    assert_same(got_b, proposals(calls[1]))
    assert set(draft._graphs) == graphs and draft.recompiles == 0


def test_forks_of_the_planted_drafter_keep_their_own_script_and_mistakes(pairs):
    """The benchmark's planted drafter (speculant/testing): each fork follows its own prompt's
    script and counts its own cycles, so its planted mistakes fall where they do alone."""
    from speculant.testing.planted_drafter import registry_with_planted

    target, _, prompts = pairs["dflash"]
    backend = {"kind": "torch", "device": "cpu", "dtype": "float32", "compile": "off"}
    plain = speculant.load_engine({"backend": backend, "target": {"path": str(target)}})
    script = [[p, plain.run(prompt_ids=p, max_new_tokens=NEW + 8, ignore_eos=True).token_ids] for p in prompts]
    engine = speculant.load_engine({"backend": backend, "target": {"path": str(target)}, "drafter": {
        "kind": "planted", "options": {"script": script, "mistakes": [2, -1, 0, 4], "default_block_size": 5}}},
        registry=registry_with_planted())
    check_interleaved_equals_solo(engine, prompts)


class Bare(Drafter):
    def prefill(self, prompt_ids, output, first_token_id):
        pass

    def propose(self, request):
        return None

    def commit(self, output, num_rows, token_ids):
        pass


def test_a_drafter_that_cannot_fork_says_which():
    with pytest.raises(NotImplementedError, match=r"^Bare cannot fork per-sequence copies \(Drafter\.fork\)"):
        Bare().fork()
