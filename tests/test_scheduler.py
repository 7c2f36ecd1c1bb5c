"""The scheduler (core/scheduler.py, issue #39): requests verified together in one target forward a
cycle, each exact as if alone. Requests of different prompt lengths and acceptance patterns (one
drafted the true continuation, so accepted whole; one drafted wrong, so rejected at 0) join as
others leave; a request running alone moves into a batch when others arrive; a cancelled one
frees its slot; a sampled one keeps the target's law beside greedy ones; each equals its solo run
token for token (float32) on every family, both backends, every built-in drafter."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.batch import BatchedTarget  # noqa: E402
from speculant.core.loop import Loop  # noqa: E402
from speculant.core.request import Request  # noqa: E402
from speculant.core.scheduler import PLAIN_AFTER, Scheduler  # noqa: E402
from speculant.testing.planted_drafter import PlantedDrafter, registry_with_planted  # noqa: E402
from test_drafter_fork import load, pairs  # noqa: E402,F401  (the fork tests' pairs: a fixture)

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]
FAMILIES = ("llama", "mistral", "gemma3_text", "gpt_oss", "qwen3_5", "qwen3_next")
NEW = 40  # crosses the sliding window (16)
PROMPTS = [list(range(5, 12)), list(range(30, 50)), list(range(60, 63)), list(range(90, 103)), list(range(140, 149))]
SCRIPTED = (0, 2, 3)  # the planted drafter proposes these prompts' true continuation; 1 and 4 it gets wrong


@pytest.fixture(scope="module")
def family(sliding_families):
    return sliding_families


def backend_config(backend: str) -> dict:
    if backend == "mlx":
        pytest.importorskip("mlx_lm")
    return {"kind": backend, "device": "cpu", "dtype": "float32"}


def planted(target, backend: str, plain: list[list[int]], **extra):
    script = [[PROMPTS[i], plain[i]] for i in SCRIPTED]
    drafter = {"kind": "planted", "options": {"script": script, "mistakes": [-1]}, "block_size": 6}
    config = {"backend": backend_config(backend), "target": {"path": str(target)}, "drafter": drafter, **extra}
    engine = load_engine(config, registry=registry_with_planted())
    engine.batch_plan.enabled = False  # every row drafts its full width: the acceptance patterns stay as planted
    return engine


def solo(engine, prompts, new=NEW, **settings) -> list[list[int]]:
    return [engine.run(prompt_ids=p, max_new_tokens=new, ignore_eos=True, **settings).token_ids for p in prompts]


def requests(engine, prompts, new=NEW, **settings) -> list[Request]:
    sampling, generation, block = engine._settings(new, {"ignore_eos": True, **settings})
    return [Request(Loop(engine, p, sampling, generation, block), generation.stop_strings, key=i)
            for i, p in enumerate(prompts)]


def drain(events, emitted: dict) -> None:
    for request, chunk in events:
        emitted.setdefault(request.key, []).extend(chunk.token_ids)


def forced_plain(engine, limits=None) -> None:
    """The batch plan keeps every row plain (or gives ``limits``), its evidence settled: the rows
    stop speculating after ``PLAIN_AFTER`` cycles, as where drafting does not pay at a load."""
    engine.batch_plan.limits = limits or (lambda rooms, stats, left=None: [0] * len(rooms))
    engine.batch_plan.settled = lambda live=(): True


def run_together(engine, prompts, budgets) -> tuple[list[Request], list[list[int]]]:
    """``prompts``, each with its own budget, started together in one scheduler: the requests and
    the tokens each emitted."""
    reqs = [requests(engine, [p], new=n)[0] for p, n in zip(prompts, budgets)]
    scheduler, emitted = Scheduler(engine, max_batch=len(reqs)), {}
    for key, request in enumerate(reqs):
        request.key = key
        scheduler.add(request)
    drain(scheduler.run(), emitted)
    return reqs, [emitted.get(i, []) for i in range(len(reqs))]


@pytest.fixture(scope="module")
def plain_tokens(family):
    cache = {}

    def get(name: str, backend: str):
        if (name, backend) not in cache:
            engine = load_engine({"backend": backend_config(backend), "target": {"path": str(family(name))}})
            cache[name, backend] = solo(engine, PROMPTS)
        return cache[name, backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_batched_requests_equal_their_solo_runs(family, plain_tokens, name, backend):
    plain = plain_tokens(name, backend)
    engine = planted(family(name), backend, plain)
    results = engine.run_many(prompt_ids=PROMPTS, max_new_tokens=NEW, ignore_eos=True, max_batch=3)
    for i, result in enumerate(results):
        assert result.token_ids == plain[i], f"request {i}"
        assert result.stats.batched_cycles > 0
        lengths = result.stats.acceptance_lengths
        if i in SCRIPTED:
            assert np.mean(lengths) > 3, lengths  # accepted whole
        else:
            assert sum(n > 1 for n in lengths) <= 1, lengths  # rejected at 0
    # the scripted requests end first, so the last prompts join at different cycles
    assert results[3].stats.batched_cycles < results[1].stats.batched_cycles


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_one_token_prompts_join_in_one_forward_and_equal_their_solo_runs(family, name, backend, monkeypatch):
    engine = load_engine({"backend": backend_config(backend), "target": {"path": str(family(name))}})
    prompts = [[5], [9], [5], [17]]
    plain = solo(engine, prompts)
    cls, grouped = type(engine.target.new_batch()), []
    join_rows = cls._join_rows
    monkeypatch.setattr(cls, "_join_rows", lambda self, rows, capture, restored=None: grouped.append(
        [len(r) for r in rows]) or join_rows(self, rows, capture, restored))
    results = engine.run_many(prompt_ids=prompts, max_new_tokens=NEW, ignore_eos=True, max_batch=4)
    assert [r.token_ids for r in results] == plain
    assert grouped == [[1, 1, 1, 1]]


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_the_flattened_layout_schedules_the_same_tokens(family, plain_tokens, name):
    """``engine.batch_layout = "flat"``: the same requests, rows end to end in one cache row; the
    plan then charges each row its own tokens (no padding)."""
    plain = plain_tokens(name, "torch")
    engine = planted(family(name), "torch", plain)
    engine.batch_layout = "flat"
    results = engine.run_many(prompt_ids=PROMPTS, max_new_tokens=NEW, ignore_eos=True, max_batch=3)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.batched_cycles > 0 for r in results) and not engine.batch_plan.padded


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["dflash", "dflash2", "mtp", "lookup"])
def test_every_drafter_batched_equals_its_solo_runs(pairs, kind, backend):  # noqa: F811
    engine, prompts = load(pairs, kind, backend, compile="auto")
    engine.batch_plan.enabled = False
    prompts = prompts + [prompts[0][3:], prompts[1][:9]]  # four lengths
    want = solo(engine, prompts)
    results = engine.run_many(prompt_ids=prompts, max_new_tokens=NEW, ignore_eos=True, max_batch=3)
    assert [r.token_ids for r in results] == want
    assert all(r.stats.batched_cycles > 0 for r in results[:3])  # the fourth may end up alone


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_every_drafter_equals_its_solo_runs_when_later_prompts_join_in_chunks(pairs, kind, backend,
                                                                              monkeypatch):  # noqa: F811
    """Prompts joining a decoding batch a chunk a cycle still hand the drafter every captured row."""
    engine, prompts = load(pairs, kind, backend, compile="auto")
    engine.batch_plan.enabled = False
    monkeypatch.setattr(batch_class(backend), "join_tokens", 3)
    begun = []
    begin_join = BatchedTarget.begin_join
    monkeypatch.setattr(BatchedTarget, "begin_join", lambda self, key, *args: begun.append(key) or
                        begin_join(self, key, *args))
    prompts = prompts + [prompts[0][3:], prompts[1][:9]]
    lengths = [3 * NEW, NEW // 4, 3 * NEW, NEW // 4, NEW]  # they end apart: later prompts join rows that decode
    want = [solo(engine, [p], new=n)[0] for p, n in zip(prompts, lengths)]
    engine.prefix_store.max_bytes = 0  # else each prompt is restored from its solo run, its last token left to run
    reqs = [requests(engine, [p], new=n)[0] for p, n in zip(prompts, lengths)]
    scheduler, emitted = Scheduler(engine, max_batch=2), {}
    for key, request in enumerate(reqs):
        request.key = key
        scheduler.add(request)
    drain(scheduler.run(), emitted)
    assert [emitted[i] for i in range(len(prompts))] == want
    assert len(begun) >= 2  # the prompts after the first two joined a chunk a cycle


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_running_alone_moves_into_the_batch(pairs, backend):  # noqa: F811
    engine, prompts = load(pairs, "dflash", backend, compile="auto", ahead="on")
    prompts = prompts + [prompts[0][5:]]
    want = solo(engine, prompts)
    first, *others = requests(engine, prompts)
    scheduler, emitted = Scheduler(engine, max_batch=4), {}
    scheduler.add(first)
    events = scheduler.run()
    for _ in range(3):  # three chunks alone, on the target's own cache (drafting ahead)
        request, chunk = next(events)
        emitted.setdefault(request.key, []).extend(chunk.token_ids)
    assert scheduler.rows is None and first.loop.stats.drafts_ahead > 0
    for request in others:
        scheduler.add(request)
    drain(events, emitted)
    assert [emitted[i] for i in range(len(prompts))] == want
    assert 0 < first.loop.stats.batched_cycles < first.loop.stats.verify_steps
    assert first.loop.stats.cache_moves >= 1 and first.loop.stats.cache_rebuilds == 0  # copied in


def test_a_lookup_row_without_a_copy_is_planned_as_a_plain_step(pairs):  # noqa: F811
    """Prompt lookup on its own drafts only where the context repeats: the plan is told so (a row
    without a copy has no room), else it prices gains that no copy will bring (on SmolLM2 at 32
    requests the padded blocks it widened for them ran at half plain batched speed)."""
    engine = load_engine({"backend": backend_config("torch"), "target": {"path": str(pairs["dflash"][0])},
                          "drafter": {"kind": "none", "lookup": True}})
    rooms, limits = [], engine.batch_plan.limits
    engine.batch_plan.limits = lambda room, stats, left=None: rooms.append(list(room)) or limits(room, stats, left)
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(30, 50))]
    want = solo(engine, prompts, new=16)
    results = engine.run_many(prompt_ids=prompts, max_new_tokens=16, ignore_eos=True, max_batch=2)
    assert [r.token_ids for r in results] == want
    # neither prompt's end has occurred before; then the first falls into a loop (copies) while
    # the second has none yet
    assert rooms[0] == [0, 0] and [7, 0] in rooms


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookup_turned_off_in_a_batch_copies_again_once_its_request_runs_alone(pairs, backend):  # noqa: F811
    """Where the plan keeps every row plain for ``PLAIN_AFTER`` cycles, the rows stop speculating;
    prompt lookup on its own needs nothing the batch skipped (only tokens), so the request that
    goes on alone after the others left takes its copies up again, its output unchanged."""
    engine = load_engine({"backend": backend_config(backend), "target": {"path": str(pairs["dflash"][0])},
                          "drafter": {"kind": "none", "lookup": True}})
    prompts, budgets = [[5, 6, 7, 8, 9] * 6, [5, 6, 7, 8, 9] * 4], (80, 16)  # both loop: copies
    want = [solo(engine, [p], new=n)[0] for p, n in zip(prompts, budgets)]
    forced_plain(engine)
    reqs, emitted = run_together(engine, prompts, budgets)
    assert emitted == want
    first = reqs[0].loop.stats
    assert first.batched_cycles >= PLAIN_AFTER and first.cache_moves >= 1  # batched, then alone
    assert first.batch_note.startswith("decoded plainly from token") and "drafted again from token" in first.batch_note
    assert first.lookup_steps > 0 and first.verify_steps < 80 - 16  # copies accepted, alone
    assert "drafted again" not in (reqs[1].loop.stats.batch_note or "")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["dflash", "dflash2", "mtp"])
def test_a_drafter_turned_off_in_a_batch_drafts_again_alone_after_a_capturing_prefill(pairs, kind, backend):  # noqa: F811
    """A drafter that reads hidden states missed them while the batch kept it off; the request that
    goes on alone captures them in one prefill of its context and drafts again, its output unchanged."""
    engine, prompts = load(pairs, kind, backend)
    budgets = (80, 16)
    want = [solo(engine, [p], new=n)[0] for p, n in zip(prompts, budgets)]
    forced_plain(engine)
    reqs, emitted = run_together(engine, prompts, budgets)
    assert emitted == want
    first = reqs[0].loop.stats
    assert first.batch_note.startswith("decoded plainly from token") and "after a prefill of its" in first.batch_note
    assert first.cache_moves >= 1 and sum(first.submitted_per_position) > 0  # drafted alone
    if kind != "dflash2":  # (this tiny DFlash2 draft is accepted nowhere, alone either)
        assert max(first.acceptance_lengths) > 1, first.acceptance_lengths  # its drafts accepted again


def test_a_request_past_its_drafting_context_stays_plain_alone(pairs):  # noqa: F811
    """Past the verifier's ``max_context`` a request decodes plainly: going on alone after the batch
    turned its drafter off, it does not capture hidden states again for a drafter it will not use."""
    target, drafter, prompts = pairs["dflash"]
    engine = load_engine({"backend": backend_config("torch"), "target": {"path": str(target)}, "drafter": drafter,
                          "verifier": {"kind": "adaptive", "options": {"max_context": 40}}})
    want = [solo(engine, [p], new=n)[0] for p, n in zip(prompts, (80, 16))]
    forced_plain(engine)
    reqs, emitted = run_together(engine, prompts, (80, 16))
    assert emitted == want
    first = reqs[0].loop.stats
    assert first.cache_moves >= 1 and first.batch_note.startswith("decoded plainly")
    assert "drafted again" not in first.batch_note and sum(first.submitted_per_position) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["lookup", "dflash"])
def test_a_drafter_turned_off_in_a_batch_drafts_again_when_fewer_rows_make_it_pay(pairs, kind, backend):  # noqa: F811
    """Rows stopped at three rows draft again when one leaves and, at two rows, a request joining
    would draft (BatchPlan.drafting_pays): still batched, outputs unchanged. Prompt lookup from the
    tokens; DFlash after a prefill of its context that captures the hidden states it missed."""
    drafter = {"kind": "none", "lookup": True} if kind == "lookup" else pairs["dflash"][1]
    engine = load_engine({"backend": backend_config(backend), "target": {"path": str(pairs["dflash"][0])},
                          "drafter": drafter})
    prompts, budgets = [[5, 6, 7, 8, 9] * 6, [5, 6, 7, 8, 9] * 5, [5, 6, 7, 8, 9] * 4], (48, 48, 16)
    want = [solo(engine, [p], new=n)[0] for p, n in zip(prompts, budgets)]
    # three rows: every row plain; two: every draft verified whole
    forced_plain(engine, lambda rooms, stats, left=None: [0] * 3 if len(rooms) == 3 else list(rooms))
    engine.batch_plan.drafting_pays = lambda rows, room, live=(): rows <= 1
    reqs, emitted = run_together(engine, prompts, budgets)
    assert emitted == want
    for request in reqs[:2]:
        stats = request.loop.stats
        assert stats.batch_note.startswith("decoded plainly"), stats.batch_note  # joined plain, or stopped
        assert "drafted again from token" in stats.batch_note and "beside 1 other requests" in stats.batch_note
        assert ("after a prefill" in stats.batch_note) == (kind == "dflash")
        drafted = stats.lookup_steps if kind == "lookup" else sum(stats.submitted_per_position)
        assert drafted > 0 and stats.cache_moves == 0  # drafts verified in the batch
        assert max(stats.acceptance_lengths) > 1, stats.acceptance_lengths
    assert "drafted again" not in reqs[2].loop.stats.batch_note


def test_a_whole_batch_is_planned_toward_its_last_request_once_none_waits(pairs):  # noqa: F811
    """``generate_many`` wants every result together: once no request waits, the plan is given
    each row's tokens still to make (BatchPlan._toward_the_end); a scheduler a server feeds, never."""
    engine = load_engine({"backend": backend_config("torch"), "target": {"path": str(pairs["dflash"][0])},
                          "drafter": {"kind": "none", "lookup": True}})
    calls, limits = [], engine.batch_plan.limits
    engine.batch_plan.limits = lambda room, stats, left=None: calls.append(left) or limits(room, stats, left)
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(30, 50)), list(range(60, 70))]
    want = solo(engine, prompts, new=16)
    assert [r.token_ids for r in engine.run_many(prompt_ids=prompts, max_new_tokens=16, ignore_eos=True,
                                                 max_batch=2)] == want
    assert calls[0] is None  # the third request waits
    given = [left for left in calls if left is not None]
    assert given and all(0 < n <= 16 for left in given for n in left)
    assert sum(given[-1]) < sum(given[0])
    calls.clear()
    scheduler = Scheduler(engine, max_batch=2)
    for request in requests(engine, prompts[:2], new=16):
        scheduler.add(request)
    drain(scheduler.run(), {})
    assert calls and all(left is None for left in calls)



@pytest.mark.parametrize("cancelled", [(0,), (1,), (0, 1, 2)])
def test_requests_cancelled_before_they_join_end_alone(family, plain_tokens, cancelled):
    """Requests cancelled while they wait (a client gone from a server's queue) and admitted
    together with others end with nothing, and the others join and run as alone. Ending the first
    before the others joined ended the new batch under them (a server campaign found every request
    of that batch failing)."""
    plain = plain_tokens("llama", "torch")
    engine = load_engine({"backend": backend_config("torch"), "target": {"path": str(family("llama"))}})
    reqs = requests(engine, PROMPTS[:3], new=6)
    for i in cancelled:
        reqs[i].loop.cancel.set()
    scheduler, emitted, ends = Scheduler(engine, max_batch=3), {}, {}
    for request in reqs:
        scheduler.add(request)
    for request, chunk in scheduler.run():
        emitted.setdefault(request.key, []).extend(chunk.token_ids)
        ends[request.key] = chunk.stop_reason
    for i in range(3):
        assert (emitted[i], ends[i]) == (([], "cancelled") if i in cancelled else (plain[i][:6], "max_new_tokens")), i
    assert scheduler.rows is None and not scheduler.live  # the batch is gone with its last request

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_cancelled_request_frees_its_slot_and_changes_nobody(family, plain_tokens, backend):
    plain = plain_tokens("llama", backend)
    engine = planted(family("llama"), backend, plain)
    reqs = requests(engine, PROMPTS[:3])
    scheduler, emitted, live = Scheduler(engine, max_batch=2), {}, []
    for request in reqs:
        scheduler.add(request)
    for request, chunk in scheduler.run():
        emitted.setdefault(request.key, []).extend(chunk.token_ids)
        live.append(len(scheduler.live))
        if request.key == 1 and len(emitted[1]) >= 3:
            request.loop.cancel.set()  # mid-request, between cycles of the batch
    assert reqs[1].loop.stats.stop_reason == "cancelled"
    assert emitted[1] == plain[1][: len(emitted[1])] and len(emitted[1]) < NEW
    assert emitted[0] == plain[0] and emitted[2] == plain[2]
    assert reqs[2].loop.stats.batched_cycles > 0  # joined in the freed slot
    assert max(live) == 2


def test_a_drafter_that_cannot_fork_leaves_batched_requests_plain(family, plain_tokens, monkeypatch):
    plain = plain_tokens("llama", "torch")
    engine = planted(family("llama"), "torch", plain)

    def refuse(self):
        raise NotImplementedError("PlantedDrafter cannot fork")

    monkeypatch.setattr(PlantedDrafter, "fork", refuse)
    results = engine.run_many(prompt_ids=PROMPTS[:3], max_new_tokens=NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == plain[:3]
    notes = [r.stats.batch_note for r in results]
    assert notes.count(None) == 1 and "cannot fork" in (notes[1] or "")


def test_a_target_that_cannot_batch_takes_turns(family, plain_tokens, monkeypatch):
    plain = plain_tokens("llama", "torch")
    engine = planted(family("llama"), "torch", plain)

    def refuse(layout="padded"):
        raise ValueError("no batches here")

    monkeypatch.setattr(engine.target, "new_batch", refuse)
    reqs = requests(engine, PROMPTS[:3])
    scheduler, emitted = Scheduler(engine, max_batch=3), {}
    for request in reqs:
        scheduler.add(request)
    drain(scheduler.run(), emitted)
    assert [emitted[i] for i in range(3)] == plain[:3]
    assert scheduler.batch_refused == "no batches here"
    assert all(r.loop.stats.batched_cycles == 0 for r in reqs)


TREES = {"kind": "tree", "options": {"budget": 6, "width": 2}}


@pytest.mark.parametrize(("name", "verifier"), [("llama", "speculative_sampling"), ("qwen3_5", "speculative_sampling"),
                                                ("llama", "tree")])
def test_a_sampled_request_beside_greedy_ones_follows_the_target(family, name, verifier):
    """The first two tokens of requests sampled at temperature 1, verified in a batch beside two
    greedy requests, follow the target's own two-token law (chi-square over many seeds). Each
    batch holds six sampled requests with seeds of their own (six times fewer batches to run);
    rows that drew the same numbers would repeat each sample six times, which the chi-square test
    rejects for a law as spread out as this random target's. With the tree verifier the second
    token comes from a tree's root (sample and match) verified in the batch."""
    from speculant.core.sampling import target_probs
    from speculant.core.types import SamplingParams
    from stats_helpers import gof_pvalue

    target = family(name)
    drafter = {"kind": "planted", "options": {"script": [], "mistakes": [-1]}, "block_size": 4}
    engine = load_engine({"backend": backend_config("torch"), "target": {"path": str(target)}, "drafter": drafter,
                          "verifier": TREES if verifier == "tree" else {"kind": verifier}},
                         registry=registry_with_planted())
    engine.batch_plan.enabled = False  # every row drafts from the first cycle: the second token is verified
    prompt, ops = PROMPTS[1], engine.backend.ops

    def next_probs(ids):
        engine.target.reset()
        logits = engine.target.prefill(ids).logits[-1:]
        return ops.to_numpy(target_probs(ops, logits, SamplingParams(temperature=1.0)))[0].astype(np.float64)

    first = next_probs(prompt)
    top = int(np.argmax(first))
    second = next_probs(prompt + [top])
    firsts, pairs_ = [], []
    per_batch = 6
    for batch in range(1200 // per_batch):
        greedy = requests(engine, [PROMPTS[0], PROMPTS[3]], new=3)
        sampled = [requests(engine, [prompt], new=3, temperature=1.0, seed=batch * per_batch + i)[0]
                   for i in range(per_batch)]
        for i, request in enumerate(sampled):
            request.key = f"sampled {i}"
        scheduler, emitted = Scheduler(engine, max_batch=2 + per_batch), {}
        for request in [greedy[0], *sampled, greedy[1]]:
            scheduler.add(request)
        drain(scheduler.run(), emitted)
        for request in sampled:
            assert request.loop.stats.batched_cycles > 0
            assert verifier != "tree" or request.loop.stats.verifier["trees"] > 0
            a, b = emitted[request.key][:2]
            firsts.append(a)
            if a == top:
                pairs_.append(b)
    assert gof_pvalue(np.array(firsts), first) > 1e-3
    assert len(pairs_) > 50 and gof_pvalue(np.array(pairs_), second) > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_5"])
def test_a_request_moves_its_caches_into_a_batch_and_back(family, plain_tokens, name, backend):
    """A request running alone moves into a batch when another arrives, and back onto the
    target's own cache when that one ends: its caches are copied both ways, not rebuilt by a
    prefill of its context, and its tokens equal its solo run (dense, sliding-window and Gated
    DeltaNet targets)."""
    plain = plain_tokens(name, backend)
    engine = planted(family(name), backend, plain)
    long, short = requests(engine, [PROMPTS[1]], new=NEW)[0], requests(engine, [PROMPTS[0]], new=6)[0]
    long.key = "long"  # rejected at 0 every cycle: a token a cycle, still going when the short one ends
    scheduler, emitted, alone = Scheduler(engine, max_batch=2), {}, []
    scheduler.add(long)
    events = scheduler.run()
    for _ in range(3):  # alone, on the target's own cache
        request, chunk = next(events)
        emitted.setdefault(request.key, []).extend(chunk.token_ids)
    assert scheduler.rows is None
    scheduler.add(short)
    for request, chunk in events:
        emitted.setdefault(request.key, []).extend(chunk.token_ids)
        alone.append(scheduler.rows is None)
    assert emitted[0] == plain[0][:6] and emitted["long"] == plain[1]
    assert alone[0] is False and alone[-1] is True  # batched, then alone again
    assert 0 < long.loop.stats.batched_cycles < long.loop.stats.verify_steps
    assert (long.loop.stats.cache_moves, long.loop.stats.cache_rebuilds) == (2, 0)
    # its state was stored at its end, through both moves: the next turn resumes it
    turn = PROMPTS[1] + emitted["long"] + [3, 4]
    resumed = engine.run(prompt_ids=turn, max_new_tokens=8, ignore_eos=True)
    assert resumed.stats.cached_tokens == len(PROMPTS[1]) + NEW - 1
    engine.prefix_store.clear()
    assert resumed.token_ids == engine.run(prompt_ids=turn, max_new_tokens=8, ignore_eos=True).token_ids



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_request_whose_context_is_shorter_than_the_convolution_moves_into_a_batch(family, name, backend):
    """A Gated DeltaNet layer of the target's own cache holds fewer convolution inputs than its
    kernel (4) while the context is shorter; moved into a batch it is joined by rows holding the
    kernel's (a campaign found the join failing on PyTorch: one request of a 1-token prompt, a
    second arriving two tokens later)."""
    engine = load_engine({"backend": backend_config(backend), "target": {"path": str(family(name))}})
    prompts = [[40], [41, 42]]
    want = solo(engine, prompts, new=12)
    first, second = requests(engine, prompts, new=12)
    scheduler, emitted = Scheduler(engine, max_batch=2), {}
    scheduler.add(first)
    for request, chunk in scheduler.run():
        emitted.setdefault(request.key, []).extend(chunk.token_ids)
        if request is first and len(emitted[0]) == 2:
            scheduler.add(second)
    assert [emitted[0], emitted[1]] == want
    assert first.loop.stats.cache_moves >= 1 and second.loop.stats.batched_cycles > 0

def batch_class(backend: str):
    if backend == "mlx":
        from speculant.backends.mlx.batch import MLXBatch

        return MLXBatch
    from speculant.backends.torch.batch import TorchBatch

    return TorchBatch


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama", "gemma3_text", "qwen3_5"])
def test_a_long_prompt_joins_a_chunk_a_cycle_while_the_others_decode(family, plain_tokens, name, backend,
                                                                      monkeypatch):
    """A prompt longer than the batch's ``join_tokens`` joining a batch that decodes prefills one
    chunk between two cycles of the others, so they keep emitting; then it decodes as its solo run."""
    plain = plain_tokens(name, backend)
    engine = planted(family(name), backend, plain)
    monkeypatch.setattr(batch_class(backend), "join_tokens", 4)  # 20 tokens: 5 chunks, then the last token
    decoder, joiner = requests(engine, [PROMPTS[4], PROMPTS[1]])  # both drafted wrong: a token a cycle
    scheduler, emitted, chunked = Scheduler(engine, max_batch=2), {}, []
    scheduler.add(decoder)
    events = scheduler.run()
    drain([next(events)], emitted)  # the decoder alone, on the target's own cache
    scheduler.add(joiner)
    while_joining = 0
    for request, chunk in events:
        chunked.append(len(scheduler.prefilling))
        if request is decoder and 1 not in emitted:
            while_joining += 1
        drain([(request, chunk)], emitted)
    assert emitted[0] == plain[4] and emitted[1] == plain[1]
    assert max(chunked) == 1 and while_joining >= 5
    assert joiner.loop.stats.batched_cycles > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_cancelled_while_its_long_prompt_joins_frees_its_slot(family, plain_tokens, backend, monkeypatch):
    plain = plain_tokens("llama", backend)
    engine = planted(family("llama"), backend, plain)
    monkeypatch.setattr(batch_class(backend), "join_tokens", 4)
    decoder, joiner, late = requests(engine, [PROMPTS[4], PROMPTS[1], PROMPTS[3]])
    scheduler, emitted = Scheduler(engine, max_batch=2), {}
    scheduler.add(decoder)
    events = scheduler.run()
    drain([next(events)], emitted)
    scheduler.add(joiner)
    scheduler.add(late)  # waits: the joiner holds the second slot while it prefills
    for request, chunk in events:
        drain([(request, chunk)], emitted)
        if request is decoder and len(emitted[0]) == 3:
            assert scheduler.prefilling and scheduler.waiting == 1
            joiner.loop.cancel.set()
    assert joiner.loop.stats.stop_reason == "cancelled" and emitted.get(1, []) == []
    assert emitted[0] == plain[4] and emitted[2] == plain[3]
    assert late.loop.stats.batched_cycles > 0 and not scheduler.prefilling and scheduler.rows is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_long_prompt_joining_beside_plain_rows_still_feeds_its_drafter(pairs, backend, monkeypatch):  # noqa: F811
    """The rows a chunked join captures for its drafter are read with the joiner counted, so a
    drafting request joining rows that all decode plainly still drafts from the target's states."""
    engine, prompts = load(pairs, "dflash", backend, compile="auto")
    engine.batch_plan.enabled = False
    engine.prefix_store.max_bytes = 0
    monkeypatch.setattr(batch_class(backend), "join_tokens", 3)
    want = solo(engine, prompts[:2])
    plain_row, joiner = requests(engine, prompts[:2])
    plain_row.loop.speculating = False  # as the plan leaves a row that drafting does not pay for
    scheduler, emitted = Scheduler(engine, max_batch=2), {}
    scheduler.add(plain_row)
    events = scheduler.run()
    drain([next(events)], emitted)
    scheduler.add(joiner)
    drain(events, emitted)
    assert [emitted[0], emitted[1]] == want
    assert joiner.loop.stats.batched_cycles > 0 and np.mean(joiner.loop.stats.acceptance_lengths) > 2
