"""The MLX target's whole forward compiled over a static cache (speculant/backends/mlx/static.py):
DFlash speculation over it gives the eager target's plain greedy tokens and acceptance lengths,
rolls back across rejected blocks and buffer growth, starts each request with small buffers, and
a target whose forward differs over these buffers is caught at load and stays eager."""

from __future__ import annotations

import numpy as np
import pytest

import speculant

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

PROMPT = 40
NEW = 90  # the cache grows past 32, 64, 96 and 128 rows


@pytest.fixture(scope="module")
def pair():
    """The shipped pair: a trained draft whose blocks its target partly accepts, partly rejects."""
    from speculant.embedded import PAIR_DIR

    return PAIR_DIR / "target", PAIR_DIR / "dflash"


def engine(pair, compile: str, drafter: bool = True, ahead: str = "auto"):
    target, draft = pair
    config = {"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": compile,
                          "draft_ahead": ahead},
              "target": {"path": str(target)}}
    if drafter:
        config["drafter"] = {"kind": "dflash", "path": str(draft), "block_size": 8}
    return speculant.load_engine(config)


def prompt() -> list[int]:
    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    return corpus_prompts(PAIR_DIR / "target", 1, PROMPT, seed=1234, held_out=True)[0].tolist()


def test_capacity_steps():
    from speculant.core.buffers import STEP, capacity_for

    for rows in range(1, 5000, 7):
        capacity = capacity_for(rows)
        assert capacity >= rows and capacity % STEP == 0
        assert capacity - rows < max(STEP, rows / 8 + 1)
    assert len({capacity_for(rows) for rows in range(1, 4097)}) < 60  # traces per width, to 4096 rows


def test_speculation_over_the_static_cache_is_lossless(pair):
    compiled, eager = engine(pair, "on"), engine(pair, "off")
    assert compiled.target._static is not None and eager.target._static is None
    ids = prompt()
    plain = eager.without_drafter().run(prompt_ids=ids, max_new_tokens=NEW, ignore_eos=True)
    fast = compiled.run(prompt_ids=ids, max_new_tokens=NEW, ignore_eos=True)
    slow = eager.run(prompt_ids=ids, max_new_tokens=NEW, ignore_eos=True)
    assert fast.token_ids == plain.token_ids == slow.token_ids
    assert fast.stats.mean_acceptance_length == slow.stats.mean_acceptance_length
    assert 1.2 < fast.stats.mean_acceptance_length < 7.5  # blocks both accepted and rejected
    assert compiled.target._static.cache[0].capacity >= PROMPT + NEW


def test_a_new_request_starts_with_small_buffers(pair):
    compiled = engine(pair, "on", drafter=False)
    target = compiled.target
    compiled.run(prompt_ids=prompt(), max_new_tokens=NEW, ignore_eos=True)
    assert target._static.cache[0].capacity >= PROMPT + NEW
    short = compiled.run(prompt_ids=prompt()[:5], max_new_tokens=3, ignore_eos=True)
    assert target._static.cache[0].capacity == 32
    again = engine(pair, "off", drafter=False).run(prompt_ids=prompt()[:5], max_new_tokens=3, ignore_eos=True)
    assert short.token_ids == again.token_ids


def test_a_forward_that_differs_is_caught_at_load(pair, monkeypatch):
    """A model that attended over rows past the offset (its own mask, say) would read stale rows:
    the load-time check compares against mlx-lm's cache and keeps the target eager."""
    import mlx.core as mx

    from speculant.backends.mlx.static import StaticKVCache

    monkeypatch.setattr(StaticKVCache, "make_mask", lambda self, n, **_: mx.ones((n, self.capacity), dtype=mx.bool_))
    target = engine(pair, "on", drafter=False).target
    assert target._static is None
    assert "whole forward not compiled: a compiled forward differed from mlx-lm's cache" in target.fast_path


# -- the draft step compiled with the target (speculant/drafters/dflash/mlx_compiled.py) ----------

def test_the_draft_step_follows_the_target(pair):
    assert "compiled draft step" in engine(pair, "on").drafter.fast_path
    assert engine(pair, "off").drafter.net.compiled is None


def test_a_new_request_keeps_the_draft_traces(pair):
    """reset drops the compiled draft's buffers, not its compiled function (its traces)."""
    e = engine(pair, "on")
    compiled = e.drafter.net.compiled
    step = compiled._compiled
    e.run(prompt_ids=prompt(), max_new_tokens=20, ignore_eos=True)
    assert compiled.rows > 0
    e.drafter.net.reset()
    assert e.drafter.net.compiled is compiled and compiled._compiled is step and compiled.rows == 0


def test_the_target_traces_once_per_shape_and_reports_it(pair):
    """A second request of the same shapes traces nothing more, and ``fast_path`` (also in the
    request's stats) counts the traces and their time."""
    import re

    e = engine(pair, "on")
    first = e.run(prompt_ids=prompt(), max_new_tokens=40, ignore_eos=True)
    traces = e.target._static._traced.copy()
    assert len(traces) > 2  # widths 1 and 8 at least, over the buffers' sizes
    second = e.run(prompt_ids=prompt(), max_new_tokens=40, ignore_eos=True)
    assert e.target._static._traced == traces and second.token_ids == first.token_ids
    counted = re.search(r"(\d+) traces in (\d+\.\d+) s", second.stats.fast_path)
    assert counted and int(counted.group(1)) == len(traces) and float(counted.group(2)) > 0


@pytest.mark.parametrize("ahead", ["off", "on"])
def test_a_sliding_draft_wraps_its_ring_losslessly(pair, ahead):
    """The shipped draft's layers all slide (window 256): past 271 positions its compiled step
    writes round a ring; tokens and acceptance lengths equal the eager draft's."""
    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    ids = corpus_prompts(PAIR_DIR / "target", 1, 300, seed=99, held_out=True)[0].tolist()
    results = []
    for compile in ("on", "off"):
        e = engine(pair, compile, ahead=ahead)
        results.append(e.run(prompt_ids=ids, max_new_tokens=60, ignore_eos=True))
        if compile == "on":
            compiled = e.drafter.net.compiled
            assert compiled.rows == compiled.ring == 255 + 2 * 8
    assert results[0].token_ids == results[1].token_ids
    assert results[0].stats.acceptance_lengths == results[1].stats.acceptance_lengths
    assert (results[0].stats.drafts_ahead > 0) == (ahead == "on")


def test_a_full_attention_draft_grows_its_buffers_losslessly(tmp_path):
    """A planted pair whose draft layers attend to every context row: blocks are mostly accepted,
    so a compiled draft that proposed anything else would lose acceptance."""
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target, plant_checkpoint

    target = build_tiny_target(tmp_path / "target", seed=0, hidden_size=64, num_layers=4,
                               max_position_embeddings=4096)
    plant_checkpoint(target, strength=4.0, soften=0.2)
    draft = build_tiny_dflash(tmp_path / "draft", target, seed=7, num_layers=2, block_size=8, scale=0.1)
    ids = [10 + i % 200 for i in range(20)]
    results = []
    for compile in ("on", "off"):
        e = engine((target, draft), compile)
        results.append(e.run(prompt_ids=ids, max_new_tokens=300, ignore_eos=True))
        if compile == "on":
            assert e.drafter.net.compiled.ring is None and e.drafter.net.compiled.rows >= 320
    assert results[0].token_ids == results[1].token_ids
    assert results[0].stats.acceptance_lengths == results[1].stats.acceptance_lengths
    assert results[0].stats.mean_acceptance_length > 6


@pytest.mark.parametrize("kind", ["sliding", "full"])
def test_compiled_draft_hidden_states_equal_the_eager_ones(pair, tmp_path, kind):
    """Cycle by cycle (a prompt, then 1 .. 8 accepted rows a cycle), the compiled step's draft
    hidden states equal the eager step's: no unwritten, stale or out-of-window row is read.
    The shipped draft slides (its ring wraps after 271 positions); a tiny one attends to all."""
    import mlx.core as mx

    from speculant.testing.tiny import build_tiny_dflash

    if kind == "full":
        pair = (pair[0], build_tiny_dflash(tmp_path / "draft", pair[0], seed=7, num_layers=2, block_size=8))
    nets = [engine(pair, compile).drafter.net for compile in ("on", "off")]
    assert nets[0].compiled is not None and nets[1].compiled is None
    width = len(nets[0].cfg.target_layer_ids) * nets[0].cfg.hidden_size
    rng = np.random.default_rng(5)
    context, prompt_rows = 0, 260
    for accepted in [prompt_rows, 3, 8, 1, 5, 2, 8, 8, 4, 7, 6, 8, 8, 1]:
        features = mx.array(rng.standard_normal((accepted, width)).astype(np.float32))
        ids = mx.array([int(rng.integers(5, 200))] + [nets[0].cfg.mask_token_id] * 7, dtype=mx.int32)
        got, want = (np.array(net.hidden(features, context, ids, context + accepted)) for net in nets)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        context += accepted
    assert context > 271


def address(a) -> int:
    view = np.array(a, copy=False)
    return view.__array_interface__["data"][0]


def test_forwards_write_the_buffers_in_place(pair):
    """Nothing keeps the old buffers alive while a step is evaluated, so MLX donates them to
    ``slice_update``: a kept reference would copy every layer's cache at every step."""
    import mlx.core as mx

    target = engine(pair, "on", drafter=False).target
    target.reset()
    mx.eval(target.prefill(prompt()).logits)
    for _ in range(3):
        before = [address(c.keys) for c in target.cache]
        mx.eval(target.forward(mx.array([5, 6, 7], dtype=mx.int32)).logits)
        assert [address(c.keys) for c in target.cache] == before
        target.crop(target.cache_length - 1)


SCRIPT = """
import threading, speculant
from speculant.embedded import PAIR_DIR
engine = speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": "on"},
                                "target": {"path": str(PAIR_DIR / "target")},
                                "drafter": {"kind": "dflash", "path": str(PAIR_DIR / "dflash"), "block_size": 8}})
run = lambda: engine.run(prompt_ids=list(range(10, 50)), max_new_tokens=20, ignore_eos=True)
worker = threading.Thread(target=run)
worker.start()
worker.join()
print("ran")
"""


def test_a_worker_thread_running_compiled_forwards_leaves_a_clean_exit():
    """As the server does: compiled forwards on a thread other than the main one. Without
    destroying that thread's MLX streams as it ends (threads.py) the process aborted at exit in
    about two runs of three, so three runs catch it 26 times in 27."""
    import subprocess
    import sys

    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-2000:]


# -- sliding-window layers: a ring --------------------------------------------------------------

def walk(target, rng, prompt: int, steps: int) -> list[np.ndarray]:
    """Logits of a prompt (in chunks) then ``steps`` verify blocks of 1 .. 12 rows, each keeping
    a random prefix; ``rng`` decides the same walk for every target given the same seed."""
    import mlx.core as mx

    target.reset()
    out = [np.array(target.prefill([int(t) for t in rng.integers(5, 300, prompt)]).logits)]
    for _ in range(steps):
        width = int(rng.integers(1, 13))
        start = target.cache_length
        out.append(np.array(target.forward(mx.array(rng.integers(5, 300, width), dtype=mx.int32)).logits))
        target.crop(start + int(rng.integers(1, width + 1)))
    return out


@pytest.mark.parametrize("rows", ["stepped", "exact"])
@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_sliding_layers_over_a_ring_give_the_rollback_caches_logits(name, rows, tmp_path, monkeypatch):
    """A window of 8 over prompts in chunks of 20 and 60 blocks (the ring wraps many times, grows
    for the prompt's chunks and shrinks back for the blocks, and every block rolls back somewhere):
    every forward's logits equal those over the rollback caches (caches.py). ``exact`` buffers
    have no rows to spare, so a ring one row short, or a window off by one, fails."""
    from speculant.backends.mlx import static
    from speculant.backends.mlx import target as target_module
    from speculant.testing.tiny_families import build_tiny_family

    monkeypatch.setattr(target_module, "PREFILL_STEP", 20)
    if rows == "exact":
        monkeypatch.setattr(static, "capacity_for", lambda n: n)
    path = build_tiny_family(tmp_path / name, name, sliding_window=8)
    targets = [speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32",
                                                  "compile": compile}, "target": {"path": str(path)}}).target
               for compile in ("on", "off")]
    assert targets[0]._static is not None and targets[1]._static is None
    for request, prompt in enumerate([50, 25]):  # the second: a ring cut before it wraps
        walks = [walk(t, np.random.default_rng(request), prompt, 60) for t in targets]
        for step, (got, want) in enumerate(zip(*walks)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"request {request}, forward {step}")
    ring = [c for c in targets[0].cache if c.window is not None][0]
    assert ring.capacity < targets[0].cache_length  # it wrapped round

    # the ring's scatter is written in place too, once its size has settled
    import mlx.core as mx

    target = targets[0]
    for _ in range(3):
        before = [address(c.keys) for c in target.cache if c.window is not None]
        mx.eval(target.forward(mx.array([5, 6, 7], dtype=mx.int32)).logits)
        assert [address(c.keys) for c in target.cache if c.window is not None] == before
        target.crop(target.cache_length - 1)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_gated_deltanet_layers_compiled_give_the_eager_logits(name, tmp_path, monkeypatch):
    """The hybrids' whole forward compiled: their DeltaNet states pass through it, and a verify
    block returns its per-position states, so a crop at any depth leaves the eager target's
    state (every forward's logits equal, over the same walk as the sliding test)."""
    from speculant.backends.mlx import target as target_module
    from speculant.testing.tiny_families import build_tiny_family

    monkeypatch.setattr(target_module, "PREFILL_STEP", 20)
    path = build_tiny_family(tmp_path / name, name)
    targets = [speculant.load_engine({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32",
                                                  "compile": compile}, "target": {"path": str(path)}}).target
               for compile in ("on", "off")]
    assert targets[0]._static is not None and targets[1]._static is None
    assert "Gated DeltaNet layers over a static cache" in targets[0].fast_path
    for request, prompt in enumerate([50, 25]):
        walks = [walk(t, np.random.default_rng(request), prompt, 40) for t in targets]
        for step, (got, want) in enumerate(zip(*walks)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"request {request}, forward {step}")
