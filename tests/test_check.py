"""``speculant check``: it passes an exact pairing and catches a broken one (greedy and sampling)."""

from __future__ import annotations

import json

import pytest

import speculant
from speculant.check import check_greedy, check_sampling, chi_square_sf
from speculant.cli import main
from speculant.core.types import SamplingParams, Verification
from speculant.verifiers.speculative_sampling import SpeculativeSamplingVerifier

PROMPTS = [[5, 6, 7], list(range(20, 44))]


class AcceptEverything(SpeculativeSamplingVerifier):
    """A broken verifier: keeps every drafted token, then the target's argmax as the bonus."""

    def verify(self, ops, draft, target_logits, sampling, rng):
        drafted = [] if draft is None else ops.to_list(draft.token_ids)
        bonus = int(ops.to_list(ops.argmax(target_logits[len(drafted):len(drafted) + 1]))[0])
        return Verification(len(drafted), drafted + [bonus])


def config(pair, **sampling):
    return {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
            "target": {"path": str(pair["target"])},
            "drafter": {"kind": "dflash", "path": str(pair["draft"]), "block_size": 8},
            "sampling": sampling}


@pytest.fixture(scope="module")
def engine(planted_pair):
    return speculant.load_engine(config(planted_pair))


@pytest.fixture(scope="module")
def broken(planted_pair):
    e = speculant.load_engine(config(planted_pair))
    e.verifier = AcceptEverything()
    return e


@pytest.mark.parametrize("x,dof,expected", [(3.84146, 1, 0.05), (18.307, 10, 0.05), (0.1, 4, 0.99879),
                                            (40.0, 20, 0.00500), (120.0, 3, 7.7168e-26)])
def test_chi_square_tail(x, dof, expected):
    assert chi_square_sf(x, dof) == pytest.approx(expected, rel=2e-3, abs=0)


def test_greedy_check_passes_an_exact_pairing(engine):
    results = check_greedy(engine, PROMPTS, 40)
    assert [r.ok for r in results] == [True, True]
    assert all(r.new_tokens == 40 for r in results)
    assert max(r.mean_acceptance_length for r in results) > 1.3  # drafts were accepted, so it tested something


def test_greedy_check_names_the_first_difference(broken, engine):
    results = check_greedy(broken, PROMPTS, 40)
    bad = [r for r in results if not r.ok]
    assert bad, "accepting every draft must change greedy output"
    plain = engine.without_drafter().run(prompt_ids=PROMPTS[bad[0].prompt_index], max_new_tokens=40,
                                         ignore_eos=True).token_ids
    first = bad[0].first_difference
    assert plain[first] == bad[0].plain_token != bad[0].speculative_token


def test_sampling_check_passes_the_exact_verifier_and_fails_a_broken_one(engine, broken):
    sampling = SamplingParams(1.0, 1.0, 8)
    good = check_sampling(engine, PROMPTS[0], 300, sampling, tokens=3)
    assert good.degrees_of_freedom >= 5 and good.per_position.get(1, 0) >= 1
    assert good.ok, good
    bad = check_sampling(broken, PROMPTS[0], 300, sampling, tokens=3)
    assert not bad.ok, bad


def test_cli_check_exit_codes(planted_pair, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["def f(x):", "import os"]))
    args = ["check", "--target", str(planted_pair["target"]), "--draft", str(planted_pair["draft"]),
            "--device", "cpu", "--dtype", "float32", "--prompts", str(prompts), "--max-new-tokens", "24", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and len(report["greedy"]) == 2 and report["sampling"] is None
    assert main(["check", "--target", str(planted_pair["target"]), "--prompt", "x"]) == 2  # no drafter: usage error
