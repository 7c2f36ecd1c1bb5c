"""Parity with the official reference ``dflash.model_mlx`` (package ``dflash`` 0.1.0) on identical
weights: the same new tokens and the same acceptance length in every cycle.

The reference runs in its own virtual environment (tests/reference/harness.py); without it these
tests are skipped. For sliding-window drafts the reference is run with its rotating cache kept in
temporal order (``mlx_temporal_rotating_cache``): stock mlx-lm returns that buffer rotated when a
single row is appended to a full window, and the reference masks by buffer index, so it would
hide the wrong context rows; speculant follows the PyTorch reference there.
"""

from __future__ import annotations

import pytest

import speculant

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
harness = pytest.importorskip("reference.harness")
pytestmark = [pytest.mark.reference, pytest.mark.mlx]

LONG = list(range(20, 52))
CASES = [  # (draft, prompt, block size, max new tokens)
    ("draft", [5, 6, 7], 8, 40),
    ("draft", LONG, 16, 24),
    ("draft", [5], 2, 12),
    ("draft_swa", [5, 6, 7], 4, 40),
    ("draft_swa", LONG, 16, 24),
]


@pytest.fixture(scope="module")
def engines(planted_pair):
    out = {}
    for name in ("draft", "draft_swa"):
        out[name] = speculant.load_engine({
            "backend": {"kind": "mlx", "device": "cpu", "dtype": "float32"},
            "target": {"path": str(planted_pair["target"])},
            "drafter": {"kind": "dflash", "path": str(planted_pair[name])},
        })
    return out


@pytest.mark.parametrize("draft, prompt, block_size, max_new", CASES,
                         ids=[f"{d}-p{len(p)}-b{b}" for d, p, b, _ in CASES])
def test_same_tokens_and_acceptance_as_dflash_model_mlx(reference_venv, engines, planted_pair,
                                                       draft, prompt, block_size, max_new):
    ref = harness.run_reference("mlx", planted_pair["target"], planted_pair[draft], prompt, max_new, block_size,
                                mlx_temporal_rotating_cache=draft == "draft_swa")
    ours = engines[draft].run(prompt_ids=prompt, max_new_tokens=max_new, block_size=block_size, ignore_eos=True)
    assert ours.token_ids == ref["tokens"]
    assert ours.stats.acceptance_lengths == ref["acceptance_lengths"]


def test_stop_token_inside_a_block_like_the_reference(reference_venv, engines, planted_pair):
    plain = engines["draft"].run(prompt_ids=[5, 6, 7], max_new_tokens=40, block_size=8, ignore_eos=True).token_ids
    stop = next(t for i, t in enumerate(plain) if i >= 4 and t not in plain[:i])
    ref = harness.run_reference("mlx", planted_pair["target"], planted_pair["draft"], [5, 6, 7], 40, 8,
                                stop_token_ids=[stop])
    ours = engines["draft"].run(prompt_ids=[5, 6, 7], max_new_tokens=40, block_size=8,
                                stop_token_ids=[stop], ignore_eos=True)
    assert ours.token_ids == ref["tokens"] and ours.token_ids[-1] == stop
    assert ours.stats.acceptance_lengths == ref["acceptance_lengths"]
