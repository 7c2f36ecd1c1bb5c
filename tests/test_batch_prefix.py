"""The prefix cache under the batch scheduler (core/scheduler.py, core/prefix_request.py,
backends' ``batch_rows.py``): a request joining a batch resumes the longest stored prefix of its
prompt in its own row and prefills only the rest; a batched request that ends stores its row as a
single-sequence snapshot. Each equals its cold solo run token for token (float32), on a dense
target, a sliding-window one (Gemma 3: a restored row's window columns) and a Gated DeltaNet
hybrid (Qwen3.5: its convolution and recurrent states), on both backends.

Two different stored prefixes are restored into rows of one batch, one of them twice (the second
row joining a running batch after the first has cycled), and the stored snapshot serves a solo
request afterwards: a row given another row's state, or a snapshot changed by the row restored
from it, gives other tokens. A planted drafter (its blocks rejected at chosen positions) captures
a target layer, and the rows its ``prefill`` gets must be the cold run's: the drafter's context is
rebuilt from the stored rows.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.loop import Loop  # noqa: E402
from speculant.core.request import Request  # noqa: E402
from speculant.core.scheduler import Scheduler  # noqa: E402
from speculant.testing.planted_drafter import PlantedDrafter, registry_with_planted  # noqa: E402

# MLX's default on the CPU is the compiled path (static buffers, their own snapshot format), as
# PyTorch's is on CUDA (its static cache, slow to compile on the CPU)
# traced and functionalized graphs, run without inductor (conftest.py; inductor: test_fast_path_torch.py)
MARKS = {"torch-compiled": [pytest.mark.slow, pytest.mark.compiler("aot_eager")], "mlx": [pytest.mark.mlx],
         "mlx-eager": [pytest.mark.mlx]}
SETTINGS = {"torch": {"kind": "torch"}, "torch-compiled": {"kind": "torch", "compile": "on"}, "mlx": {"kind": "mlx"},
            "mlx-eager": {"kind": "mlx", "compile": "off"}}
FAMILIES = ("llama", "gemma3_text", "qwen3_5")  # dense; sliding windows (16); Gated DeltaNet 3 : 1
# every family on every backend, but the compiled PyTorch path (minutes on the CPU) on the hybrid only
CASES = [pytest.param(name, backend, marks=MARKS.get(backend, []), id=f"{name}-{backend}")
         for backend in SETTINGS for name in FAMILIES if backend != "torch-compiled" or name == "qwen3_5"]
NEW = 20
SHARED_A, SHARED_B = list(range(20, 60)), list(range(200, 236))
# (prompt, tokens to generate): two extend A, one B, one shares nothing; the first ends early, so
# the last joins a running batch in its slot
PROMPTS = [(SHARED_A + [7, 8, 9], 6), (SHARED_B + [11, 12], NEW), (list(range(100, 131)), NEW), (SHARED_A + [13], NEW)]
CACHED = [len(SHARED_A), len(SHARED_B), 0, len(SHARED_A)]


@pytest.fixture(scope="module")
def family(sliding_families):
    return sliding_families


@pytest.fixture
def drafter_rows(monkeypatch):
    """The captured target rows each ``PlantedDrafter.prefill`` got, by prompt."""
    seen: dict[tuple[int, ...], np.ndarray] = {}
    prefill = PlantedDrafter.prefill

    def recording(self, prompt_ids, output, first_token_id):
        seen[tuple(int(t) for t in prompt_ids)] = np.asarray(output.features.tolist())
        return prefill(self, prompt_ids, output, first_token_id)

    monkeypatch.setattr(PlantedDrafter, "prefill", recording)
    return seen


_ENGINES: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _engines_freed():
    yield
    _ENGINES.clear()


def engine_for(path, backend: str, script=(), store: bool = True):
    """A planted engine, one per target, backend and store setting for the module (a compiled one
    costs a compile per width), handed out with ``script``, an empty prefix store and the padded
    layout, as if new."""
    if backend.startswith("mlx"):
        pytest.importorskip("mlx_lm")
    key = (str(path), backend, store)
    if key not in _ENGINES:
        config = {"backend": {**SETTINGS[backend], "device": "cpu", "dtype": "float32"}, "target": {"path": str(path)},
                  "drafter": {"kind": "planted", "block_size": 5,
                              "options": {"mistakes": [0, 2, -1], "target_layer_ids": [1]}}}
        if not store:
            config["prefix_cache"] = {"max_bytes": 0}
        _ENGINES[key] = load_engine(config, registry=registry_with_planted())
    engine = _ENGINES[key]
    engine.batch_plan.enabled = False  # every row drafts its full width: the rejections stay as planted
    engine.batch_layout = "padded"
    engine.drafter.scripts = {tuple(prompt): list(continuation) for prompt, continuation in script}
    if store:
        engine.prefix_store.clear()
    return engine


def run_batch(engine, prompts: list[tuple[list[int], int]], max_batch: int = 3) -> list[Request]:
    """The requests, run by one scheduler ``max_batch`` at a time, in order."""
    scheduler, requests = Scheduler(engine, max_batch), []
    for key, (prompt, new) in enumerate(prompts):
        sampling, generation, block = engine._settings(new, {"ignore_eos": True})
        requests.append(Request(Loop(engine, prompt, sampling, generation, block), generation.stop_strings, key))
        scheduler.add(requests[-1])
    for _ in scheduler.run():
        pass
    return requests


def cold_runs(path, backend: str, prompts) -> list[list[int]]:
    engine = engine_for(path, backend, store=False)
    return [engine.run(prompt_ids=p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in prompts]


def assert_rows_as_cold(drafter_rows, cold_rows, prompts) -> None:
    for prompt, _ in prompts:
        got, want = drafter_rows[tuple(prompt)], cold_rows[tuple(prompt)]
        assert got.shape == want.shape, f"prompt of {len(prompt)} tokens"
        assert np.allclose(got, want, rtol=1e-4, atol=1e-3), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_batched_requests_resume_stored_prefixes(family, drafter_rows, name, backend):
    path = family(name)
    truth = cold_runs(path, backend, PROMPTS + [(SHARED_A + [14], NEW)])
    cold_rows = dict(drafter_rows)
    engine = engine_for(path, backend, script=[(p, t) for (p, _), t in zip(PROMPTS, truth)])
    for shared in (SHARED_A, SHARED_B):
        engine.run(prompt_ids=shared, max_new_tokens=4, ignore_eos=True)  # alone: stores the prefix
    requests = run_batch(engine, PROMPTS)
    for i, request in enumerate(requests):
        stats = request.final().stats
        assert request.loop.produced == truth[i], f"request {i}"
        assert stats.cached_tokens == CACHED[i], f"request {i}"
        assert stats.batched_cycles > 0, f"request {i}"
    # the first ended while the third ran on, so the last (waiting for a slot) joined a running batch
    assert requests[0].loop.stats.batched_cycles < requests[2].loop.stats.batched_cycles
    assert_rows_as_cold(drafter_rows, cold_rows, PROMPTS)
    # the snapshot two rows were restored from is as it was stored
    after = engine.run(prompt_ids=SHARED_A + [14], max_new_tokens=NEW, ignore_eos=True)
    assert after.stats.cached_tokens == len(SHARED_A) and after.token_ids == truth[4]


TOGETHER = [(SHARED_A + [7, 8, 9], NEW), (SHARED_B + [11, 12, 13], NEW), (SHARED_A + [21, 22, 23], NEW),
            (SHARED_B + [31, 32], NEW)]  # tokens after the stored prefixes: 3, 3, 3, 2
ONE_EACH = [(SHARED_A + [7], NEW), (SHARED_B + [11], NEW), (SHARED_A + [21], NEW)]  # one token each after them


@pytest.mark.parametrize(("name", "backend"), CASES)
@pytest.mark.parametrize("one_each", [False, True])
def test_requests_restoring_stored_prefixes_join_together(family, drafter_rows, name, backend, monkeypatch, one_each):
    """Requests admitted together that resume stored prefixes (two prefixes, of 40 and 36
    tokens) prefill the rest of their prompts as rows of one forward, each after its own restored
    positions (a hybrid's group: equal rests only), and each equals its cold run; also when each
    has one token left to run (until 2026-12-06 those joined one forward each)."""
    prompts = ONE_EACH if one_each else TOGETHER
    path = family(name)
    truth = cold_runs(path, backend, prompts)
    cold_rows = dict(drafter_rows)
    engine = engine_for(path, backend, script=[(p, t) for (p, _), t in zip(prompts, truth)])
    for shared in (SHARED_A, SHARED_B):
        engine.run(prompt_ids=shared, max_new_tokens=4, ignore_eos=True)  # alone: stores the prefix
    cls, grouped = type(engine.target.new_batch()), []
    join_rows = cls._join_rows
    monkeypatch.setattr(cls, "_join_rows", lambda self, prompts, capture, restored=None: grouped.append(
        sorted(len(p) - r[1] for p, r in zip(prompts, restored or [(None, 0)] * len(prompts))))
        or join_rows(self, prompts, capture, restored))
    requests = run_batch(engine, prompts, max_batch=4)
    for i, request in enumerate(requests):
        assert request.loop.produced == truth[i], f"request {i}"
        assert request.final().stats.cached_tokens == len(SHARED_A if i % 2 == 0 else SHARED_B), f"request {i}"
    if one_each:
        assert grouped == [[1, 1, 1]]
    else:
        assert grouped == ([[3, 3, 3]] if name == "qwen3_5" else [[2, 3, 3, 3]])
    assert_rows_as_cold(drafter_rows, cold_rows, prompts)


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_the_flattened_layout_resumes_stored_prefixes(family, name):
    """``engine.batch_layout = "flat"``: a joining sequence's restored columns follow the others'
    in the one row; it stores no snapshot of its own (its columns lie among the others')."""
    path = family(name)
    truth = cold_runs(path, "torch", PROMPTS)
    engine = engine_for(path, "torch", script=[(p, t) for (p, _), t in zip(PROMPTS, truth)])
    engine.batch_layout = "flat"
    for shared in (SHARED_A, SHARED_B):
        engine.run(prompt_ids=shared, max_new_tokens=4, ignore_eos=True)  # alone: stores the prefix
    requests = run_batch(engine, PROMPTS)
    for i, request in enumerate(requests):
        assert request.loop.produced == truth[i], f"request {i}"
        assert request.final().stats.cached_tokens == CACHED[i], f"request {i}"


@pytest.mark.parametrize(("name", "backend"), CASES)
def test_batched_requests_store_their_state_for_the_next_turn(family, drafter_rows, name, backend):
    path = family(name)
    first = cold_runs(path, backend, PROMPTS[1:3])
    # the next turn: the conversation so far (prompt and reply) and a new message
    turns = [(p + reply + [5, 6], NEW) for (p, _), reply in zip(PROMPTS[1:3], first)]
    truth = cold_runs(path, backend, turns)
    cold_rows = dict(drafter_rows)
    engine = engine_for(path, backend)
    # stored from their rows as they end, a request that runs on in the first row
    ended = run_batch(engine, [(list(range(300, 320)), NEW + 10)] + PROMPTS[1:3])
    assert [r.loop.produced for r in ended[1:]] == first
    requests = run_batch(engine, turns)  # a batch again
    solo = engine.run(prompt_ids=turns[0][0], max_new_tokens=NEW, ignore_eos=True)  # and alone
    for request, (prompt, _), want in zip(requests, turns, truth):
        assert request.loop.produced == want
        # the stored state covers the prompt and the reply but its last token (never run)
        assert request.final().stats.cached_tokens >= len(prompt) - 3
        assert request.loop.stats.batched_cycles > 0
    assert solo.token_ids == truth[0] and solo.stats.cached_tokens >= len(turns[0][0]) - 3
    assert_rows_as_cold(drafter_rows, cold_rows, turns)


def test_a_request_cancelled_before_its_prefill_stores_nothing(family):
    """Its caches still hold the previous request's state: stored under its own prompt, that state
    would be restored into the next request with this prompt."""
    engine = engine_for(family("qwen3_5"), "torch")
    before, prompt = list(range(20, 60)), list(range(250, 295))
    engine.run(prompt_ids=before, max_new_tokens=4, ignore_eos=True)
    generation = engine.generate(prompt_ids=prompt, max_new_tokens=NEW, ignore_eos=True)
    generation.cancel()
    assert list(generation)[-1].stop_reason == "cancelled"
    result = engine.run(prompt_ids=prompt, max_new_tokens=NEW, ignore_eos=True)
    assert result.stats.cached_tokens == 0
    assert result.token_ids == cold_runs(family("qwen3_5"), "torch", [(prompt, NEW)])[0]


@pytest.mark.parametrize("backend", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("name", ["gemma3_text", "qwen3_5"])
def test_requests_sharing_a_system_prompt_checkpoint_it_in_the_batch(family, name, backend):
    """An agent's requests: one system prompt, different questions, all joining one batch. On a
    sliding or hybrid target no snapshot of a whole prompt serves another; the second request's
    join stores one at the end of the shared prefix, and the third resumes from it."""
    path = family(name)
    prompts = [(SHARED_A + question, NEW) for question in ([7, 8, 9], [11, 12, 13, 14], [15, 16])]
    truth = cold_runs(path, backend, prompts)
    engine = engine_for(path, backend)
    requests = run_batch(engine, prompts)
    assert [r.loop.produced for r in requests] == truth
    assert [r.loop.stats.cached_tokens for r in requests] == [0, 0, len(SHARED_A)]
    assert all(r.loop.stats.batched_cycles > 0 for r in requests)
