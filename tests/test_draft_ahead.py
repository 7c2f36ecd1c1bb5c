"""Drafting ahead (``backend.draft_ahead``): the next cycle's DFlash draft is made before this
cycle's verification is read, as if the block is accepted whole, and kept only when it was.

It must change nothing but timing: the same tokens as plain decoding, the same acceptance
lengths and the same draft hidden rows as drafting after each verification, whether the draft
made ahead is kept or withdrawn (the context rows it took in are rewound), on both backends,
with full-attention and sliding-window drafts, eager and compiled."""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.testing.tiny import build_tiny_dflash, build_tiny_target, plant_checkpoint
from speculant.testing.tiny_dflash2 import build_tiny_dflash2

PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def half_planted(tmp_path_factory, torch_threads):
    """A target that follows its planted token part of the time: blocks accepted whole, then
    runs of rejections, so drafts made ahead are both kept and withdrawn."""
    root = tmp_path_factory.mktemp("ahead")
    target = build_tiny_target(root / "target", seed=0)
    plant_checkpoint(target, strength=1.0, soften=0.2)
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=8, scale=0.1)
    sliding = build_tiny_dflash(root / "draft_swa", target, seed=7, block_size=8, scale=0.1, sliding_window=4)
    dflash2 = build_tiny_dflash2(root / "dflash2", target, seed=7, block_size=8)
    return {"target": target, "draft": draft, "draft_swa": sliding, "dflash2": dflash2}


def engine(pair, draft, kind, ahead, verifier="auto", **backend):
    return speculant.load_engine({
        "backend": {"kind": kind, "device": "cpu", "dtype": "float32", "draft_ahead": ahead, **backend},
        "target": {"path": str(pair["target"])}, "verifier": {"kind": verifier},
        "drafter": {"kind": "dflash2" if draft == "dflash2" else "dflash", "path": str(pair[draft])}})


def recorded_run(eng, max_new_tokens=96):
    """The result and the draft hidden rows of every draft that was verified (a withdrawn
    draft's rows are dropped with it)."""
    drafter, ops = eng.drafter, eng.backend.ops
    hidden, withdraw = [], drafter.withdraw_ahead
    take_hidden = drafter.hidden

    def record(request, anchor=None):
        rows = take_hidden(request, anchor)
        hidden.append(ops.to_numpy(ops.float32(rows)))
        return rows

    def forget():
        hidden.pop()
        withdraw()

    drafter.hidden, drafter.withdraw_ahead = record, forget
    try:
        result = eng.run(prompt_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    finally:
        del drafter.hidden, drafter.withdraw_ahead
    return result, hidden


def assert_ahead_changes_nothing(before, after, plain_tokens):
    (off, off_rows), (on, on_rows) = before, after
    assert list(on.token_ids) == list(off.token_ids) == plain_tokens
    assert on.stats.acceptance_lengths == off.stats.acceptance_lengths
    assert off.stats.drafts_ahead == 0
    kept, made = on.stats.drafts_ahead_kept, on.stats.drafts_ahead
    assert 0 < kept < made, f"both paths must run: {kept} kept of {made}"
    assert len(on_rows) == len(off_rows)
    for a, b in zip(on_rows, off_rows):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("draft", ["draft", "draft_swa"])
def test_drafting_ahead_changes_no_token_acceptance_or_draft_row(half_planted, kind, draft):
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
    off = engine(half_planted, draft, kind, "off")
    plain = off.without_drafter().run(prompt_ids=PROMPT, max_new_tokens=96, ignore_eos=True)
    assert_ahead_changes_nothing(recorded_run(off), recorded_run(engine(half_planted, draft, kind, "on")),
                                 list(plain.token_ids))


@pytest.mark.slow
@pytest.mark.compiler("aot_eager")  # inductor's draft graphs: test_fast_path_torch.py
def test_drafting_ahead_with_the_compiled_draft_step(half_planted):
    """The compiled draft keeps context rows by position: a withdrawn draft's rows are
    overwritten by the next, never read. One engine, its setting switched between requests (each
    request reads it): a second one would compile every graph again."""
    eng = engine(half_planted, "draft", "torch", "off", compile="on")
    assert eng.drafter.net.compiled is not None, eng.drafter.net.fast_path
    plain = eng.without_drafter().run(prompt_ids=PROMPT, max_new_tokens=96, ignore_eos=True)
    off = recorded_run(eng)
    eng.backend.config.draft_ahead = "on"
    assert_ahead_changes_nothing(off, recorded_run(eng), list(plain.token_ids))


@pytest.mark.parametrize("kind", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_auto_drafts_ahead_on_gpus_only(half_planted, kind):
    """On a CPU the host's work between cycles is a sliver of the forwards: nothing to overlap."""
    if kind == "mlx":
        pytest.importorskip("mlx_lm")
    cpu = engine(half_planted, "draft", kind, "auto")
    assert not cpu.backend.asynchronous
    assert cpu.run(prompt_ids=PROMPT, max_new_tokens=32, ignore_eos=True).stats.drafts_ahead == 0
    assert engine(half_planted, "draft", kind, "on").run(
        prompt_ids=PROMPT, max_new_tokens=32, ignore_eos=True).stats.drafts_ahead > 0


@pytest.mark.parametrize("case", ["sampling", "adaptive", "timed", "dflash2"])
def test_no_drafting_ahead_where_the_next_draft_depends_on_the_host(half_planted, case):
    """A sampled bonus is drawn on the host, the adaptive verifier plans each width from the last
    verification, timed phases wait for every draft, DFlash2's selector reads the anchor."""
    eng = engine(half_planted, "dflash2" if case == "dflash2" else "draft", "torch", "on",
                 verifier="adaptive" if case == "adaptive" else "auto")
    eng.time_phases = case == "timed"
    sampling = {"temperature": 0.8, "seed": 1} if case == "sampling" else {}
    result = eng.run(prompt_ids=PROMPT, max_new_tokens=32, ignore_eos=True, **sampling)
    assert result.stats.verify_steps > 0 and result.stats.drafts_ahead == 0
