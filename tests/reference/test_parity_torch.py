"""Parity with the official reference ``dflash.model.dflash_generate`` (package ``dflash`` 0.1.0,
PyTorch) on identical weights: the same draft proposals in every cycle (see the last-cycle note), the same greedy tokens
and the same acceptance lengths. Sliding-window drafts included (prompts longer than the window).
"""

from __future__ import annotations

import pytest

import speculant
from engine_recording import run_recording_proposals

harness = pytest.importorskip("reference.harness")
pytestmark = pytest.mark.reference

LONG = list(range(20, 52))
CASES = [  # (draft, prompt, block size, max new tokens)
    ("draft", [5, 6, 7], 8, 40),
    ("draft", [5, 6, 7], 16, 40),
    ("draft", LONG, 4, 24),
    ("draft", [5], 2, 12),
    ("draft_swa", [5, 6, 7], 8, 40),
    ("draft_swa", LONG, 16, 30),
]


@pytest.fixture(scope="module")
def engines(planted_pair):
    return {
        name: speculant.load_engine({
            "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
            "target": {"path": str(planted_pair["target"])},
            "drafter": {"kind": "dflash", "path": str(planted_pair[name])},
        })
        for name in ("draft", "draft_swa")
    }


@pytest.fixture(scope="module")
def reference_runs(reference_venv, planted_pair):
    jobs = [dict(backend="torch", target_dir=planted_pair["target"], draft_dir=planted_pair[d], prompt_ids=p,
                 max_new_tokens=n, block_size=b) for d, p, b, n in CASES]
    return harness.run_reference_batch(jobs)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{d}-p{len(p)}-b{b}" for d, p, b, _ in CASES])
def test_same_proposals_tokens_and_acceptance_as_dflash_generate(engines, reference_runs, case):
    draft, prompt, block_size, max_new = CASES[case]
    ref = reference_runs[case]
    ours, proposals = run_recording_proposals(engines[draft], prompt_ids=prompt, max_new_tokens=max_new,
                                              block_size=block_size, ignore_eos=True)
    assert ours.token_ids == ref["tokens"]
    assert ours.stats.acceptance_lengths == ref["acceptance_lengths"]
    # Near the end the reference drafts one token more than can still be emitted (verify width
    # min(block, remaining + 1)); speculant drafts only what can be emitted (min(block, remaining)).
    # Both widths follow from the tokens produced before each cycle; the proposals agree on the
    # rows both drafted, and a final cycle with one token left drafts nothing here.
    produced = 1
    ref_props = ref["proposals"]
    for i, length in enumerate(ours.stats.acceptance_lengths):
        remaining = max_new - produced
        ours_k, ref_k = min(block_size - 1, remaining - 1), min(block_size - 1, remaining)
        assert len(ref_props[i]) == ref_k
        if ours_k > 0:
            assert proposals[i] == ref_props[i][:ours_k]
        produced += length
    assert len(proposals) == sum(min(block_size - 1, max_new - 1 - sum(ours.stats.acceptance_lengths[:i]) - 1) > 0
                                 for i in range(len(ours.stats.acceptance_lengths)))
    assert sum(ours.stats.acceptance_lengths) > len(ours.stats.acceptance_lengths)  # drafts were accepted


def test_reference_baseline_equals_our_plain_decoding(reference_venv, planted_pair):
    ref = harness.run_reference("torch", planted_pair["target"], planted_pair["draft"], [5, 6, 7], 30, 1, baseline=True)
    plain = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                          "target": {"path": str(planted_pair["target"])}})
    assert plain.run(prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True).token_ids == ref["tokens"]
