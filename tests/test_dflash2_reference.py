"""Parity of DFlash2 with the official reference ``dflash`` 0.1.0 on identical weights:
``DFlash2DraftModel`` in ``dflash.model`` (PyTorch) against speculant on PyTorch, and
``dflash.model_mlx`` against speculant on MLX. The same proposals in every cycle, the same greedy
tokens and the same acceptance lengths, including prompts longer than the draft's sliding
window. Checkpoints come from the reference harness's own builder (the published layout,
written independently of speculant's) and from ``speculant.testing.tiny_dflash2``.

The MLX reference runs sliding-window drafts with its rotating cache kept in temporal order
(``mlx_temporal_rotating_cache``, see tests/reference/README.md): stock, it masks context rows
by buffer index after a one-row append; speculant follows the PyTorch reference there."""

from __future__ import annotations

import pytest

import speculant
from engine_recording import run_recording_proposals

harness = pytest.importorskip("reference.harness")
pytestmark = pytest.mark.reference

LONG = list(range(20, 52))  # 32 tokens, longer than the sliding window of 8
# (draft, prompt, block size, max new tokens). "planted": drafts are often accepted; the others
# (a random target, or unary logits scaled by 0.05) make the convolutions and the selector's
# chain decide the proposals, which a wrong walk or a missing convolution would change.
CASES = [
    ("planted", [5, 6, 7], 4, 40),
    ("planted", [5], 2, 16),
    ("planted", LONG, 4, 30),
    ("planted_swa", LONG, 4, 30),
    ("planted_swa", [5, 6, 7], 3, 30),
    ("random_swa", LONG, 4, 30),
    ("random_swa", [5, 6, 7], 4, 30),
    ("ours_swa", LONG, 8, 40),
    ("ours_swa", [5, 6, 7], 5, 40),
    ("ours_selector", LONG, 8, 40),
    ("ours_selector", [5, 6, 7], 6, 40),
]
ACCEPTING = ("planted", "planted_swa", "ours_swa")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, torch_threads):
    from reference.make_tiny_checkpoints import build_dflash2, build_target

    from speculant.testing.tiny_dflash2 import build_tiny_dflash2, build_tiny_dflash2_pair

    root = tmp_path_factory.mktemp("dflash2_ref")
    planted = build_target(root / "planted_target", planted=True, seed=0)
    random = build_target(root / "random_target", planted=False, seed=0)
    ours_target, ours = build_tiny_dflash2_pair(root / "ours", block_size=8, sliding_window=8)
    return {
        "planted": (planted, build_dflash2(root / "planted", planted, block_size=4, seed=2)),
        "planted_swa": (planted, build_dflash2(root / "planted_swa", planted, block_size=4, sliding_window=8, seed=3)),
        "random_swa": (random, build_dflash2(root / "random_swa", random, block_size=4, sliding_window=8, seed=2)),
        "ours_swa": (ours_target, ours),
        "ours_selector": (ours_target, build_tiny_dflash2(root / "ours_selector", ours_target, seed=7, block_size=8,
                                                          sliding_window=8, output_multiplier=0.05)),
    }


def has_mlx() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("mlx", "mlx_lm"))


BACKENDS = ["torch", pytest.param("mlx", marks=[pytest.mark.mlx, pytest.mark.skipif(not has_mlx(), reason="needs mlx")])]


@pytest.fixture(scope="module")
def reference_runs(reference_venv, checkpoints):
    runs = {}

    def get(backend):
        if backend not in runs:
            jobs = [dict(backend=backend, target_dir=checkpoints[d][0], draft_dir=checkpoints[d][1], prompt_ids=p,
                         max_new_tokens=n, block_size=b, mlx_temporal_rotating_cache=backend == "mlx")
                    for d, p, b, n in CASES]
            runs[backend] = harness.run_reference_batch(jobs)
        return runs[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{d}-p{len(p)}-b{b}" for d, p, b, _ in CASES])
def test_same_proposals_tokens_and_acceptance(checkpoints, reference_runs, case, backend):
    name, prompt, block_size, max_new = CASES[case]
    target, draft = checkpoints[name]
    engine = speculant.load_engine({
        "backend": {"kind": backend, "device": "cpu", "dtype": "float32"},
        "target": {"path": str(target)},
        "drafter": {"kind": "dflash2", "path": str(draft)},
    })
    ref = reference_runs(backend)[case]
    ours, proposals = run_recording_proposals(engine, prompt_ids=prompt, max_new_tokens=max_new,
                                              block_size=block_size, ignore_eos=True)
    assert ref["architecture"] == "DFlash2DraftModel"
    assert ours.token_ids == ref["tokens"]
    # Near the end the reference verifies min(block, remaining + 1) rows, one more than can still
    # be emitted; speculant drafts only what can be emitted. Attention inside the block is
    # bidirectional, so a narrower block changes every proposal (and maybe that cycle's
    # acceptance): compare every cycle up to the first one where the widths differ.
    produced, compared = 1, 0
    for i, length in enumerate(ours.stats.acceptance_lengths):
        remaining = max_new - produced
        ours_k, ref_k = min(block_size - 1, remaining - 1), min(block_size - 1, remaining)
        assert len(ref["proposals"][i]) == ref_k
        if ours_k != ref_k:
            break
        assert proposals[i] == ref["proposals"][i], f"cycle {i}"
        assert length == ref["acceptance_lengths"][i], f"cycle {i}"
        compared += 1
        produced += length
    assert compared >= len(ours.stats.acceptance_lengths) - (block_size - 1)  # only the tail can differ
    if name in ACCEPTING:
        assert sum(ours.stats.acceptance_lengths) > len(ours.stats.acceptance_lengths)  # drafts were accepted


def test_reference_loads_our_builder_output(reference_venv, checkpoints):
    """speculant's tiny DFlash2 writer produces the layout the reference loads with no missing,
    unexpected or mis-shaped tensors (torch ``from_pretrained`` and the strict MLX loader)."""
    info = harness.reference_load_info(checkpoints["ours_swa"][1])
    assert info["architecture"] == "DFlash2DraftModel"
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info["torch"][key], (key, info["torch"][key])
    assert info["mlx_parameters"]
