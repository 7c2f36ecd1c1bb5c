"""The reference harness itself: the official ``dflash`` 0.1.0 loads our tiny checkpoints with no
key errors, is lossless on them (greedy speculative tokens == its own baseline), reports
acceptance lengths and proposals consistently, and the planted pair reaches real acceptance.
Torch and MLX paths of the reference agree with each other in float32."""

from __future__ import annotations

import statistics

import pytest

from .harness import ReferenceUnavailable, run_reference, run_reference_batch, run_reference_in_process
from .make_tiny_checkpoints import PLANTED_TOKEN, build_dflash2

pytestmark = pytest.mark.reference

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88]
MAX_NEW = 24
BLOCK = 4
BACKENDS = ("torch", "mlx")
DRAFTS = ("dflash", "dflash2")


SAMPLING = dict(temperature=0.8, top_p=0.95, seed=1)


def _first_new_token_index(tokens: list[int]) -> int:
    """Index of the first token (after the second) that has not occurred before."""
    return next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def reference(reference_venv, ref_checkpoints):
    """``run_reference`` over the session's tiny checkpoints, memoised; the runs the tests below
    need are made up front in two batched reference processes (start-up dominates)."""
    memo: dict = {}

    def job(backend, pair, draft, block, **kwargs):
        ckpt = ref_checkpoints[pair]
        return dict(backend=backend, target_dir=ckpt["target"], draft_dir=ckpt[draft],
                    prompt_ids=PROMPT, max_new_tokens=MAX_NEW, block_size=block, **kwargs)

    def key(backend, pair, draft, block, **kwargs):
        return (backend, pair, draft, block, tuple(sorted(kwargs.items())))

    def prefetch(specs):
        for spec, out in zip(specs, run_reference_batch([job(*a, **kw) for a, kw in specs])):
            memo[key(*spec[0], **spec[1])] = out

    def run(backend, pair, draft, block, **kwargs):
        k = key(backend, pair, draft, block, **kwargs)
        if k not in memo:
            memo[k] = run_reference(**job(backend, pair, draft, block, **kwargs))
        return memo[k]

    specs = [((b, "planted", "dflash2", BLOCK), SAMPLING) for b in BACKENDS]
    specs += [((b, "random", "dflash", BLOCK), {"capture_logits": True}) for b in BACKENDS]
    for b in BACKENDS:
        for pair in ("random", "planted"):
            specs.append(((b, pair, "dflash", 1), {"baseline": True}))
            specs += [((b, pair, d, BLOCK), {}) for d in DRAFTS]
    prefetch(specs)
    stops = []
    for b in BACKENDS:
        tokens = run(b, "planted", "dflash", 1, baseline=True)["tokens"]
        stop = tokens[_first_new_token_index(tokens)]
        stops.append(((b, "planted", "dflash2", BLOCK), {"stop_token_ids": (stop,)}))
    prefetch(stops)
    return run


def check_cycles(out: dict, block: int, max_new: int = MAX_NEW) -> None:
    """Counting invariants plus: accepted drafts are the next emitted tokens, and the first
    rejected draft differs from the token the target emitted instead."""
    tokens, lengths, proposals = out["tokens"], out["acceptance_lengths"], out["proposals"]
    assert len(tokens) == 1 + sum(lengths)
    assert len(proposals) == len(lengths)
    committed = 1
    for length, proposal in zip(lengths, proposals):
        assert 1 <= length <= block
        assert len(proposal) == min(block, max_new - committed + 1) - 1
        accepted = length - 1
        assert proposal[:accepted] == tokens[committed:committed + accepted]
        if committed + length < len(tokens) and accepted < len(proposal):
            assert proposal[accepted] != tokens[committed + accepted]
        committed += length


def test_tiny_drafts_load_with_no_key_errors(reference_venv, ref_checkpoints):
    from safetensors import safe_open

    from .harness import reference_load_infos

    paths = [ref_checkpoints["planted"][draft] for draft in DRAFTS]
    infos = reference_load_infos(paths)
    assert [info["architecture"] for info in infos] == ["DFlashDraftModel", "DFlash2DraftModel"]
    for path, info in zip(paths, infos):
        assert info["torch"] == {"missing_keys": [], "unexpected_keys": [],
                                 "mismatched_keys": [], "error_msgs": []}
        with safe_open(str(path / "model.safetensors"), "np") as f:
            assert info["mlx_parameters"] == len(list(f.keys()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pair", ("random", "planted"))
@pytest.mark.parametrize("draft", DRAFTS)
def test_reference_greedy_is_lossless(reference, backend, pair, draft):
    baseline = reference(backend, pair, "dflash", 1, baseline=True)
    spec = reference(backend, pair, draft, BLOCK)
    assert len(baseline["tokens"]) == MAX_NEW
    assert baseline["acceptance_lengths"] == [1] * (MAX_NEW - 1)
    assert spec["block_size"] == BLOCK
    assert spec["tokens"] == baseline["tokens"]
    check_cycles(spec, BLOCK)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("draft", DRAFTS)
def test_planted_pair_is_accepted(reference, backend, draft):
    spec = reference(backend, "planted", draft, BLOCK)
    assert statistics.mean(spec["acceptance_lengths"]) > 1.5
    # Not degenerate: the target also emits other tokens, so rejections happen.
    assert any(t != PLANTED_TOKEN for t in spec["tokens"])
    assert any(length < BLOCK for length in spec["acceptance_lengths"][:-1])


@pytest.mark.parametrize("draft", DRAFTS)
def test_in_process_timing_run_matches_the_reference_venv(reference, ref_checkpoints, draft):
    """The benchmarks' in-process reference (its package on this interpreter's mlx, no
    recording wrapper) generates exactly what the reference venv's own interpreter does."""
    ckpt = ref_checkpoints["planted"]
    venv = reference("mlx", "planted", draft, BLOCK)
    for options in ({}, {"baseline": True}):
        try:
            here = run_reference_in_process("mlx", ckpt["target"], ckpt[draft], PROMPT, MAX_NEW, BLOCK, **options)
        except ReferenceUnavailable as exc:  # e.g. a newer mlx here than the venv's pinned one
            pytest.skip(str(exc))
        expected = reference("mlx", "planted", "dflash", 1, baseline=True) if options else venv
        assert here["proposals"] is None and here["decode_s"] > 0
        assert here["tokens"] == expected["tokens"]
        assert here["acceptance_lengths"] == expected["acceptance_lengths"]


@pytest.mark.parametrize("pair", ("random", "planted"))
@pytest.mark.parametrize("draft", DRAFTS)
def test_torch_and_mlx_references_agree_in_float32(reference, pair, draft):
    torch_out = reference("torch", pair, draft, BLOCK)
    mlx_out = reference("mlx", pair, draft, BLOCK)
    for key in ("tokens", "acceptance_lengths", "proposals"):
        assert torch_out[key] == mlx_out[key], key


def test_draft_logits_capture(reference):
    """Greedy DFlash v1 proposes the argmax of each draft row; both backends' logits agree."""
    import numpy as np

    outs = [reference(b, "random", "dflash", BLOCK, capture_logits=True) for b in BACKENDS]
    for out in outs:
        assert len(out["draft_logits"]) == len(out["proposals"])
        for rows, proposal in zip(out["draft_logits"], out["proposals"]):
            assert np.asarray(rows).shape == (len(proposal), 256)
            assert np.asarray(rows).argmax(-1).tolist() == proposal
    for a, b in zip(outs[0]["draft_logits"], outs[1]["draft_logits"]):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_token_is_kept_and_ends_generation(reference, backend):
    tokens = reference(backend, "planted", "dflash", 1, baseline=True)["tokens"]
    index = _first_new_token_index(tokens)
    out = reference(backend, "planted", "dflash2", BLOCK, stop_token_ids=(tokens[index],))
    assert out["tokens"] == tokens[:index + 1]
    assert len(out["tokens"]) == 1 + sum(out["acceptance_lengths"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_path_runs(reference, backend):
    out = reference(backend, "planted", "dflash2", BLOCK, **SAMPLING)
    assert len(out["tokens"]) == MAX_NEW == 1 + sum(out["acceptance_lengths"])
    assert all(0 <= t < 256 for t in out["tokens"])
    assert [len(p) for p in out["proposals"]] == [
        min(BLOCK, MAX_NEW - c + 1) - 1
        for c in (1 + sum(out["acceptance_lengths"][:i]) for i in range(len(out["proposals"])))
    ]


@pytest.mark.slow
def test_mlx_reference_sliding_window_quirk(reference_venv, ref_checkpoints, tmp_path):
    """dflash 0.1.0's MLX draft masks sliding-window context by buffer index, but mlx-lm's
    RotatingKVCache is in rotated order after a one-row append once the window is full, so
    proposals differ from the torch reference (which matches a full-cache computation) unless
    the runner's opt-in temporal-order correction is applied. Tokens stay lossless either way."""
    target = ref_checkpoints["random"]["target"]
    draft = build_dflash2(tmp_path / "dflash2_w4", target, sliding_window=4)
    common = dict(target_dir=target, draft_dir=draft, prompt_ids=PROMPT,
                  max_new_tokens=MAX_NEW, block_size=BLOCK)
    torch_out, mlx_raw, mlx_fixed = run_reference_batch([
        dict(backend="torch", **common),
        dict(backend="mlx", **common),
        dict(backend="mlx", mlx_temporal_rotating_cache=True, **common),
    ])
    assert torch_out["tokens"] == mlx_raw["tokens"] == mlx_fixed["tokens"]
    assert mlx_fixed["proposals"] == torch_out["proposals"]
    assert mlx_raw["proposals"] != torch_out["proposals"]
