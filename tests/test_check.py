"""``speculant check``: it passes an exact pairing and catches a broken one (greedy and sampling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import speculant
from speculant import embedded
from speculant.bench.workloads import load_workload
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


def test_a_rare_token_drawn_once_is_pooled_not_failed():
    """A token of probability 1e-5 drawn once in 200 draws, the rest as expected. Pooled alone (as
    before), its bin (observed 1, expected 0.002) made a statistic of about 500 and failed the
    check; the pool now takes in the least expected tokens until it expects 5 draws."""
    from collections import Counter

    import numpy as np

    from speculant.check import chi_square
    from speculant.check.sampling import pooled_bins

    probs = np.array([0.5, 0.3, 0.19999, 0.00001])
    stat, dof = chi_square(Counter({0: 100, 1: 60, 2: 39, 3: 1}), probs)
    assert chi_square_sf(stat, dof) > 0.5, (stat, dof)
    obs, exp = pooled_bins(np.array([100.0, 60, 39, 1]), probs * 200)
    assert list(obs) == [40, 60, 100] and list(exp) == pytest.approx([40, 60, 100])


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


# -- near-ties, broken verifiers, and checks that test nothing ----------------------------------
PLUGINS = Path(__file__).parent / "plugins" / "speculant-broken-verifier"


def check_cli(capsys, pair, *argv):
    args = ["check", "--target", str(pair["target"]), "--draft", str(pair["draft"]), "--device", "cpu",
            "--dtype", "float32", "--prompt", "def f(x):", "--prompt", "import os", "--max-new-tokens", "24", *argv]
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_verifier_accepting_wrong_tokens_fails_with_the_evidence(planted_pair, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    code, out, _ = check_cli(capsys, planted_pair, "-p", "speculant_broken_verifier", "--verifier", "accept_all")
    assert code == 1, out
    failure = next(line for line in out.splitlines() if "DIFFERS" in line)
    assert "beyond float32 rounding" in failure and "margin" in failure  # both paths' margins as evidence
    assert "FAILED" in out and "ok" not in out.splitlines()[-1]


def test_a_check_where_nothing_was_drafted_is_inconclusive(planted_pair, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    code, out, _ = check_cli(capsys, planted_pair, "-p", "speculant_broken_verifier", "--verifier", "never_draft")
    assert code == 1 and "INCONCLUSIVE: no drafted token was verified" in out, out


def test_a_sampling_test_without_power_is_inconclusive(planted_pair, capsys):
    # at T = 0.01 every run draws the same tokens: one bin per prefix, nothing to test
    code, out, _ = check_cli(capsys, planted_pair, "--temperature", "0.01", "--samples", "30")
    assert code == 1 and "INCONCLUSIVE" in out and ": inconclusive" in out, out


@pytest.mark.parametrize("argv,flag", [(["--samples", "-1"], "--samples"), (["--alpha", "2", "--samples", "5"], "--samples"),
                                       (["--alpha", "2"], "--alpha"), (["--alpha", "0"], "--alpha"),
                                       (["-n", "0"], "-n/--num-prompts"), (["--sample-tokens", "0"], "--sample-tokens")])
def test_settings_under_which_a_check_tests_nothing_are_refused(argv, flag, capsys):
    code = main(["check", "--target", "/nonexistent", "--draft", "/nonexistent", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"speculant: error: {flag}: "), err


@pytest.mark.skipif(not embedded.available(), reason="the shipped pair is not in this checkout")
def test_bfloat16_near_ties_of_the_shipped_pair_are_warnings(capsys):
    # a fixed verify width makes the run deterministic; in bfloat16 this prompt parts from plain
    # decoding at one near-tie (measured with `speculant check --dtype bfloat16`): at new token 20
    # on an AVX-512 CPU, at 3 on an AVX2 one (the CPU's bfloat16 kernels round differently)
    prompt = load_workload("code", None, None)[1]
    args = ["check", "--backend", "torch", "--device", "cpu", "--dtype", "bfloat16", "--verifier", "auto",
            "--prompt", prompt, "--max-new-tokens", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    warning = next(line for line in out.splitlines() if "warning" in line)
    assert "near-tie (margin" in warning and "within bfloat16 rounding" in warning
    assert "identical but for 1 near-tie(s)" in out and "ok with 1 warning(s)" in out
    assert "--dtype float32 makes it exact and repeatable" in out
    assert main([*args, "--strict", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["warnings"] == 1 and report["failures"] == 0 and not report["ok"]
    tie = report["greedy"][0]["near_ties"][0]
    assert 0 <= tie["position"] < 32 and max(abs(tie["plain_gap"]), abs(tie["block_gap"])) <= tie["bound"]
