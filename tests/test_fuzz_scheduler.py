"""A random campaign over the scheduler (issue #39): each case draws a target (dense, sliding
window, Gated DeltaNet), a drafter, a verifier, a layout, a batch size and a handful of requests:
prompts of random lengths (some shorter than a convolution kernel, repeated, or sharing a
prefix), budgets, stop strings, sampled requests beside greedy ones, requests joining late and
one cancelled. A second turn then resumes some requests from what the prefix store kept. Every
greedy request must equal the target's plain run alone, token for token; none may end in error.

The seeds are fixed, so a failure repeats (its case is in the message); ``SPECULANT_FUZZ_EXAMPLES``
scales their number for a longer local campaign. Such a campaign found the Gated DeltaNet join of
``test_scheduler.py::test_a_request_whose_context_is_shorter_than_the_convolution_moves_into_a_batch``.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.scheduler import Scheduler  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from test_drafter_fork import MLX, pairs  # noqa: E402,F401  (the fork tests' pairs: a fixture)

CASES = 12 * int(os.environ.get("SPECULANT_FUZZ_EXAMPLES", "1"))
FAMILIES = ("llama", "gemma3_text", "qwen3_5", "qwen3_next")
HYBRID = ("qwen3_5", "qwen3_next", "mtp")
VERIFIERS = {"auto": {}, "greedy": {"kind": "greedy"}, "tree": {"kind": "tree", "options": {"budget": 4}},
             "adaptive": {"kind": "adaptive"},
             "adaptive_trees": {"kind": "adaptive", "options": {"tree": "auto", "tree_budgets": [4, 8]}}}
SEEDS = [pytest.param(seed, marks=MLX) if seed % 2 else seed for seed in range(CASES)]


@dataclass
class Case:
    """What one seed draws; its ``repr`` is the failure message's context."""

    backend: str
    target: str  # "dense", "mtp" or a family
    drafter: str
    verifier: str
    max_batch: int
    whole: bool
    flat: bool
    planned: bool
    prompts: list[list[int]]
    budgets: list[int]
    stops: list[list[str]]
    sampled: list[bool]
    late: list[int]
    cancel: tuple[int, int] | None
    turn: bool
    mistakes: list[int] = field(default_factory=lambda: [-1])


def draw(seed: int, pairs) -> Case:  # noqa: F811
    r = random.Random(seed)
    drafter = r.choice(["dflash", "dflash2", "lookup", "lookup_only", "mtp", "planted", "planted"])
    target = {"mtp": "mtp", "planted": r.choice(FAMILIES)}.get(drafter, "dense")
    vocabulary = pairs["mtp"][2][0] if target == "mtp" else list(range(3, 300))
    prompts = []
    for _ in range(r.randint(2, 6)):
        length = r.choice([1, 2, 3, 5, 9, 17, 30])
        prompts.append(([5, 6, 7, 8, 9] * 6)[:length] if target != "mtp" and r.random() < 0.3
                       else [r.choice(vocabulary) for _ in range(length)])
    if r.random() < 0.4:  # a repeat, or a prefix shared with one more token
        prompts[-1] = prompts[0] + [r.choice(vocabulary)] * r.randint(0, 1)
    count = len(prompts)
    verifier = r.choice(list(VERIFIERS) if drafter != "lookup_only" else ["auto", "greedy", "adaptive"])
    return Case(
        backend="mlx" if seed % 2 else "torch", target=target, drafter=drafter, verifier=verifier,
        max_batch=r.randint(1, 4), whole=r.random() < 0.5,
        flat=not seed % 2 and target not in HYBRID and r.random() < 0.3, planned=r.random() < 0.7,
        prompts=prompts, budgets=[r.choice([1, 2, 3, 7, 16, 33]) for _ in prompts],
        stops=[[r.choice(["a", "e", "th", "\n"])] if r.random() < 0.2 else [] for _ in prompts],
        sampled=[verifier != "greedy" and r.random() < 0.2 for _ in prompts],
        late=list(range(1, count)) if r.random() < 0.3 else [i for i in range(1, count) if r.random() < 0.4],
        cancel=(r.randrange(count), r.randint(1, 8)) if r.random() < 0.3 else None,
        turn=r.random() < 0.5, mistakes=r.choice([[-1], [0], [2, -1, 1]]),
    )


@pytest.fixture(scope="module")
def plain(sliding_families, pairs):  # noqa: F811
    """``(case, prompt, budget, stops) -> tokens``: the target's plain greedy run alone."""
    engines, runs = {}, {}

    def path(case: Case) -> str:
        return str({"dense": pairs["dflash"][0], "mtp": pairs["mtp"][0]}.get(case.target)
                   or sliding_families(case.target))

    def run(case: Case, prompt: list[int], budget: int, stops: list[str] = ()) -> list[int]:
        key = (case.backend, case.target, tuple(prompt), budget, tuple(stops))
        if key not in runs:
            if (case.backend, case.target) not in engines:
                engines[case.backend, case.target] = load_engine(
                    {"backend": {"kind": case.backend, "device": "cpu", "dtype": "float32"},
                     "target": {"path": path(case)}})
            engine = engines[case.backend, case.target]
            runs[key] = engine.run(prompt_ids=prompt, max_new_tokens=budget, ignore_eos=True,
                                   stop_strings=list(stops)).token_ids
        return runs[key]

    run.path = path
    return run


def engine_for(case: Case, pairs, plain):  # noqa: F811
    drafter = {"dflash": pairs["dflash"][1], "dflash2": pairs["dflash2"][1], "lookup": pairs["lookup"][1],
               "mtp": pairs["mtp"][1], "lookup_only": {"kind": "none", "lookup": True}}.get(case.drafter)
    registry = None
    if case.drafter == "planted":  # the true continuation of every other prompt, spoiled as drawn
        script = [[p, plain(case, p, 40)] for p in case.prompts[::2]]
        drafter = {"kind": "planted", "options": {"script": script, "mistakes": case.mistakes}, "block_size": 5}
        registry = registry_with_planted()
    config = {"backend": {"kind": case.backend, "device": "cpu", "dtype": "float32"},
              "target": {"path": plain.path(case)}, "drafter": drafter, "verifier": VERIFIERS[case.verifier]}
    engine = load_engine(config, registry=registry)
    engine.batch_plan.enabled = case.planned
    if case.flat:
        engine.batch_layout = "flat"
    return engine


def scheduled(engine, requests: list, max_batch: int, whole: bool, late=(), cancel=None) -> tuple[dict, dict]:
    """Every request's emitted tokens and last chunk; ``late`` ones added one per two chunks."""
    scheduler, emitted, ends, late = Scheduler(engine, max_batch=max_batch, whole=whole), {}, {}, list(late)
    for key, request in enumerate(requests):
        request.key = key
        if key not in late:
            scheduler.add(request)
    while True:
        for count, (request, chunk) in enumerate(scheduler.run(), 1):
            emitted.setdefault(request.key, []).extend(chunk.token_ids)
            if chunk.stop_reason is not None:
                ends[request.key] = chunk
            if late and count % 2 == 0:
                scheduler.add(requests[late.pop(0)])
            if cancel and request.key == cancel[0] and len(emitted[request.key]) >= cancel[1]:
                request.loop.cancel.set()
        if not late:
            return emitted, ends
        scheduler.add(requests[late.pop(0)])  # the others ended first


@pytest.mark.parametrize("seed", SEEDS)
def test_every_greedy_request_equals_its_solo_run(seed, pairs, plain):  # noqa: F811
    case = draw(seed, pairs)
    engine = engine_for(case, pairs, plain)
    requests = []
    for i, prompt in enumerate(case.prompts):
        settings = {"temperature": 0.8, "seed": seed} if case.sampled[i] else {}
        requests.append(engine.request(prompt, case.budgets[i], ignore_eos=True, stop_strings=case.stops[i],
                                       **settings))
    emitted, ends = scheduled(engine, requests, case.max_batch, case.whole, case.late, case.cancel)
    assert sorted(ends) == list(range(len(case.prompts))), case
    for i, prompt in enumerate(case.prompts):
        assert ends[i].error is None, (i, ends[i].error, case)
        if case.sampled[i]:
            continue
        want = plain(case, prompt, case.budgets[i], case.stops[i])
        got = emitted.get(i, [])
        if ends[i].stop_reason == "cancelled":
            want = want[:len(got)]
        assert got == want, (i, ends[i].stop_reason, case)
    if not case.turn:
        return
    # a second turn of every request: its prompt, what it emitted and one token more
    turns = [p + emitted.get(i, []) + [p[0]] for i, p in enumerate(case.prompts)][:4]
    requests = [engine.request(p, 5, ignore_eos=True) for p in turns]
    emitted, ends = scheduled(engine, requests, case.max_batch, case.whole)
    for i, prompt in enumerate(turns):
        assert ends[i].error is None and emitted[i] == plain(case, prompt, 5), (i, "turn", case)
