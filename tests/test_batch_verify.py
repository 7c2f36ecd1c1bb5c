"""A batched cycle reads every greedy row's verification in one host transfer (core/scheduler.py
``_fetched``; ``Verifier.pending``; ``core.arrays.fetch_rows``), not one device synchronisation
per request, and a row whose logits are not a distribution ends alone.

- The two halves (``greedy_pending``), fetched for rows of different widths together, verify each
  row as ``greedy_verify`` does alone, on every ArrayOps; a NaN row raises for itself only.
- A plain batch of real requests makes exactly one transfer per cycle, whatever its rows.
- A target whose embedding row for one token is NaN (a real checkpoint, damaged): the request
  that emits that token stops with NonFiniteLogitsError, keeping its tokens up to it, while the
  requests beside it equal their solo runs.
- Requests that reach the context window while batched stop there (``context_length``) with their
  solo tokens, and the others go on to their own ends.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from speculant.api import load_engine  # noqa: E402
from speculant.core.arrays import fetch_rows  # noqa: E402
from speculant.core.errors import NonFiniteLogitsError  # noqa: E402
from speculant.core.scheduler import Scheduler  # noqa: E402
from speculant.core.types import Draft  # noqa: E402
from speculant.verifiers.acceptance import greedy_pending, greedy_verify  # noqa: E402
from test_verifiers import make_ops  # noqa: E402

BACKENDS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]
PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 3, 17], [70, 3, 71, 4, 72, 5, 9]]


def row_case(rng: np.random.Generator, k: int, vocab: int = 12, nan: bool = False):
    """Logits [k + 1, V] with ties, and drafts matching the argmax for a random prefix."""
    logits = rng.integers(0, 4, size=(k + 1, vocab)).astype(np.float32)  # small ints: many ties
    best = logits.argmax(axis=1)
    cut = int(rng.integers(0, k + 1))
    drafts = [int(best[i]) if i < cut else int((best[i] + 1) % vocab) for i in range(k)]
    if nan:
        logits[min(cut, k), 3] = np.nan
    return logits, drafts


@pytest.mark.parametrize("ops_name", ["numpy", "torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_rows_fetched_together_verify_as_each_alone(ops_name):
    ops = make_ops(ops_name)
    rng = np.random.default_rng(3)
    for trial in range(20):
        cases = [row_case(rng, k, nan=trial % 4 == 1 and i == 2) for i, k in enumerate((0, 1, 3, 5, 2))]
        arrays = [(ops.asarray(logits), None if not drafts else Draft(ops.asarray(drafts, "int64"), len(drafts)))
                  for logits, drafts in cases]
        pending = [greedy_pending(ops, draft, logits) for logits, draft in arrays]
        hosts = fetch_rows(ops, [p.parts for p in pending])
        for i, ((logits, draft), p, host) in enumerate(zip(arrays, pending, hosts)):
            try:
                alone = greedy_verify(ops, draft, logits)
            except NonFiniteLogitsError as exc:
                with pytest.raises(NonFiniteLogitsError, match="verify row"):
                    p.finish(host)
                assert trial % 4 == 1 and i == 2, exc
                continue
            assert p.finish(host) == alone, (trial, i)
    assert fetch_rows(ops, [[], []]) == [[], []]


@pytest.mark.parametrize("kind", ["greedy", "speculative_sampling", "tree"])
def test_chain_verifiers_verify_greedy_rows_in_two_halves_and_sampled_rows_whole(kind):
    """Every built-in verifier with a chain path (the tree verifier's included) offers the two
    halves at temperature 0, finishing as its ``verify``; sampled rows verify whole (None)."""
    from speculant.core.types import SamplingParams
    from speculant.plugins.manager import get_registry

    ops, rng = make_ops("numpy"), np.random.default_rng(5)
    verifier = get_registry().verifiers[kind]({})
    for k in (0, 1, 4):
        logits, drafts = row_case(rng, k)
        logits, draft = ops.asarray(logits), None if not drafts else Draft(ops.asarray(drafts, "int64"), k)
        p = verifier.pending(ops, draft, logits, SamplingParams(), None)
        assert p is not None and p.finish(fetch_rows(ops, [p.parts])[0]) == verifier.verify(
            ops, draft, logits, SamplingParams(), None)
    if kind != "greedy":
        assert verifier.pending(ops, draft, logits, SamplingParams(temperature=0.8), None) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plain_batch_moves_every_rows_verification_in_one_transfer(tiny_target, monkeypatch, backend):
    """Counted inside every batched cycle of three requests decoding plainly: one ``to_list``."""
    engine = load_engine({"backend": {"kind": backend, "device": "cpu", "dtype": "float32"},
                          "target": {"path": str(tiny_target)}})
    solo = [engine.run(prompt_ids=p, max_new_tokens=12).token_ids for p in PROMPTS]
    ops, calls, inside = engine.backend.ops, [], [False]
    real_list, real_cycle = ops.to_list, Scheduler._cycle
    monkeypatch.setattr(ops, "to_list", lambda x: (inside[0] and calls.__setitem__(-1, calls[-1] + 1)) or real_list(x))

    def cycle(self):
        calls.append(0)
        rows = len(self.live)
        inside[0] = True
        try:
            yield from real_cycle(self)
        finally:
            inside[0] = False
            calls[-1] = (rows, calls[-1])

    monkeypatch.setattr(Scheduler, "_cycle", cycle)
    results = engine.run_many(prompt_ids=PROMPTS, max_new_tokens=12)
    assert [r.token_ids for r in results] == solo
    batched = [(rows, n) for rows, n in calls if rows >= 2]
    assert len(batched) >= 8 and all(n == 1 for _, n in batched), calls


def nan_token(clean: list[list[int]]) -> tuple[int, int]:
    """A token the first request emits at some index >= 3 that appears nowhere before it in that
    request, nor in any other request's prompt or output: (token, its index)."""
    others = {t for i, ids in enumerate(clean) if i for t in ids + PROMPTS[i]}
    for at, token in enumerate(clean[0]):
        if at >= 3 and token not in others and token not in clean[0][:at] + PROMPTS[0]:
            return token, at
    raise AssertionError(f"no token of {clean[0]} fits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_with_nan_logits_ends_alone_with_its_tokens(tiny_target, tmp_path, backend):
    from safetensors.numpy import load_file, save_file

    config = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}}
    clean = [load_engine({**config, "target": {"path": str(tiny_target)}}).run(prompt_ids=p, max_new_tokens=16).token_ids
             for p in PROMPTS]
    token, at = nan_token(clean)
    damaged = tmp_path / "target"
    shutil.copytree(tiny_target, damaged)
    weights_file = next(damaged.glob("*.safetensors"))
    weights = load_file(str(weights_file))
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    weights[name][token] = np.nan
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    engine = load_engine({**config, "target": {"path": str(damaged)}})
    ends = {}
    for index, chunk in engine.generate_many(prompt_ids=PROMPTS, max_new_tokens=16):
        ends.setdefault(index, []).extend(chunk.token_ids)
        if chunk.stop_reason is not None:
            ends[index] = (ends[index], chunk.stop_reason, chunk.error)
    tokens, reason, error = ends[0]
    assert reason == "error" and isinstance(error, NonFiniteLogitsError), ends[0]
    assert tokens == clean[0][:at + 1]
    for i in (1, 2):
        assert ends[i][0] == clean[i] and ends[i][1] != "error", (i, ends[i])


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_rows_take_the_plans_widths_not_their_verifiers_warm_up(planted_pair, backend):
    """The adaptive verifier's warm-up and probes price widths from one request's timings; in a
    batch the plan prices them, so every batched cycle is the plan's (``batched`` in the
    verifier's actions; the forks' warm-up plain steps do not run), the tokens stay each request's
    solo ones, and a verifier freed by the batch plans the next request alone again."""
    target, draft = planted_pair["target"], planted_pair["draft"]
    engine = load_engine({"backend": {"kind": backend, "device": "cpu", "dtype": "float32"},
                          "target": {"path": str(target)}, "drafter": {"kind": "dflash", "path": str(draft)},
                          "verifier": {"kind": "adaptive"}})
    solo = [engine.run(prompt_ids=p, max_new_tokens=24) for p in PROMPTS]
    assert "plain:warmup" in solo[0].stats.verifier["actions"]  # alone: the engine's verifier warms up once
    results = engine.run_many(prompt_ids=PROMPTS, max_new_tokens=24)
    assert [r.token_ids for r in results] == [r.token_ids for r in solo]
    for r in results:
        actions = r.stats.verifier["actions"]
        assert actions.count("batched") == r.stats.batched_cycles > 0 and "plain:warmup" not in actions, actions
    after = engine.run(prompt_ids=PROMPTS[0], max_new_tokens=24)  # on the engine's verifier, freed by the batch
    assert after.token_ids == solo[0].token_ids and "batched" not in after.stats.verifier["actions"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_requests_reaching_the_context_window_stop_there_alone(planted_pair, backend):
    engine = load_engine({"backend": {"kind": backend, "device": "cpu", "dtype": "float32"},
                          "target": {"path": str(planted_pair["target"])},
                          "drafter": {"kind": "dflash", "path": str(planted_pair["draft"])}})
    window = engine.target.info.max_position_embeddings
    prompts = [[5, 6, 7] * ((window - 20) // 3), [5, 6], [7, 8, 9], [5, 6, 7] * ((window - 40) // 3)]
    results = engine.run_many(prompt_ids=prompts, max_new_tokens=60, ignore_eos=True)
    assert [r.stats.stop_reason for r in results] == ["context_length", "max_new_tokens", "max_new_tokens",
                                                      "context_length"]
    assert [len(p) + len(r.token_ids) for p, r in zip(prompts, results)] == [window, 62, 63, window]
    assert all(r.stats.batched_cycles > 0 for r in results)
    solo = [engine.run(prompt_ids=p, max_new_tokens=60, ignore_eos=True).token_ids for p in prompts]
    assert [r.token_ids for r in results] == solo
