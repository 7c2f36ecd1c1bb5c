"""The fast-path benchmark scripts still run end to end (smoke size): they are not timed tests,
but #23's figures come from them, so a script that broke would go unnoticed until a GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_fast_path_benchmark_runs_and_its_arms_agree():
    out = run("benchmarks/fast_path.py", "--backend", "torch", "--small", "--no-reference", "--pairs", "shipped,mid")
    assert "torch / shipped" in out and "torch / mid" in out
    assert out.count("identical tokens across arms: True") == 2, out


@pytest.mark.slow
def test_cpu_layouts_benchmark_prints_every_layout():
    out = run("benchmarks/cpu_layouts.py", "--pairs", "shipped")
    assert "shipped: 57 linear layers" in out
    for rows in ("(1,)", "(8,)", "(1, 8)"):
        line = next(l for l in out.splitlines() if f"rows {rows}, every layer in turn" in l)
        assert all(f"{kind} " in line for kind in ("dense", "transposed", "packed")), line


@pytest.mark.slow
@pytest.mark.reference
def test_gpu_check_script_runs_its_steps_on_a_cpu(tmp_path, reference_venv):
    """benchmarks/gpu_check.sh has had no GPU to run on: its steps (the reference environment's
    check, the device check, the benchmark with the reference loop) run here on a CPU, at smoke
    size, against the reference venv the parity tests use, with a Qwen3.5 hybrid's mid pair and
    trees against chains (greedy and sampled) too."""
    import os

    ref = Path(reference_venv).parents[1]  # <venv>/bin/python
    env = {**os.environ, "SPECULANT_REF_VENV": str(ref), "XDG_CACHE_HOME": str(tmp_path), "FAMILY": "qwen3_5",
           "TREES": "chain,tree8", "TREE_PROMPTS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--no-install", "--small"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "[gpu_check] reference: torch" in out and "[gpu_check] device cpu" in out, out
    assert "torch / shipped" in out and out.count("torch / mid") == 2 and "qwen3_5" in done.stderr
    assert out.count("identical tokens across arms: True") == 3, out
    ratio = [line for line in out.splitlines() if "speculant dflash / reference dflash (tok/s)" in line]
    assert len(ratio) == 3, out
    assert out.count('"arm": "tree8"') == 2 and '"temperature": 0.8' in out and '"greedy_mismatches": 0' in out, out
    assert not list((ref / "lib").glob("python*/site-packages/zz_speculant_torch.pth"))  # left as it was


@pytest.mark.mlx
def test_expert_layout_benchmark_gives_the_same_products():
    pytest.importorskip("mlx.core")
    out = run("benchmarks/expert_layout.py", "--experts", "4", "--hidden", "64", "--intermediate", "96",
              "--rows", "1,8", "--repeats", "1")
    differences = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "as loaded / transposed" in line]
    assert len(differences) == 2 and max(differences) <= 1e-4, out


@pytest.mark.slow
def test_batch_verify_benchmark_runs():
    out = run("benchmarks/batch_verify.py", "--rows", "1,2", "--cycles", "2", "--context", "32", "--hidden", "64")
    assert "rows   2: batched" in out, out


def test_batch_generate_benchmark_reports_every_arm_and_identical_outputs(tmp_path, planted_pair):
    """#39's benchmark on a tiny planted pair: every arm timed at each concurrency, the batched
    requests' tokens equal to their single-stream runs (the script counts any difference)."""
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"backend": {"kind": "torch", "dtype": "float32"},
                                  "target": {"path": str(planted_pair["target"])},
                                  "drafter": {"kind": "dflash", "path": str(planted_pair["draft"])}}))
    out = tmp_path / "batch.json"
    run("benchmarks/batch_generate.py", "--config", str(config), "--concurrency", "1,3", "--max-new-tokens", "6",
        "--repeats", "2", "--solo-prompts", "2", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["mismatches"] == 0 and report["backend"] == "torch"
    assert [row["concurrency"] for row in report["rows"]] == [1, 3]
    for row in report["rows"]:
        for key in ("spec_tok_s", "plain_tok_s", "single_tok_s", "spec_over_plain", "spec_over_single",
                    "spec_mean_acceptance", "single_mean_acceptance"):
            assert row[key] > 0, (key, row)
        assert row["spec_mismatches"] == row["plain_mismatches"] == 0
        assert len(row["per_repeat_tok_s"]["spec"]) == 2
    assert report["rows"][1]["spec_batched_cycles_mean"] > 0  # the three requests did verify batched
    three = report["rows"][1]
    assert 0 < three["plain_forwards"] <= three["plain_computed_tokens"] <= 3 * three["plain_forwards"]  # a token a row
    assert three["spec_computed_tokens"] > three["spec_forwards"] > 0


def test_batch_generate_builds_a_hybrid_mid_pair(tmp_path):
    """``--mid H,L --family qwen3_5``: a Gated DeltaNet hybrid's batched rows against its plain
    batched decoding, every request equal to its single-stream run."""
    out = tmp_path / "batch.json"
    text = run("benchmarks/batch_generate.py", "--mid", "64,4", "--family", "qwen3_5", "--concurrency", "2",
               "--max-new-tokens", "6", "--repeats", "1", "--arms", "spec,plain", "--out", str(out))
    report = json.loads(out.read_text())
    assert "mid 64,4 qwen3_5" in text and report["mismatches"] == 0, text
    assert report["layer_types"] == ["full_attention", "linear_attention"], report["layer_types"]
    assert report["rows"][0]["spec_computed_tokens"] > report["rows"][0]["spec_forwards"] > 0


def test_batch_joins_benchmark_reports_both_measurements(tmp_path, planted_pair):
    """benchmarks/batch_joins.py: joining together against one by one (the same first tokens, or
    it exits 1), the waits while a long prompt joins, chunked and whole, and while a request that
    ran alone moves into a batch, copied and rebuilt (the same tokens, or it exits 1)."""
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"backend": {"kind": "torch", "dtype": "float32"},
                                  "target": {"path": str(planted_pair["target"])}}))
    out = run("benchmarks/batch_joins.py", "--config", str(config), "--requests", "3", "--long-tokens", "30",
              "--repeats", "1", "--shared-tokens", "20")
    assert "joins  3 prompts" in out and "MISMATCH" not in out, out
    assert "shared 3 prompts behind a restored 20-token prefix" in out, out
    assert "whole  : longest wait" in out and "chunked: longest wait" in out, out
    assert "rebuilt: wait" in out and "copied: wait" in out, out


@pytest.mark.slow
def test_adaptive_replay_records_and_replays_the_policy(tmp_path):
    """benchmarks/adaptive_replay.py (docs/history: where ``adaptive`` lost to the chain): the
    record holds a whole block at every output position, aligned with the output (the draft made
    at position t proposes output t + 1 onwards: misaligned, almost no first draft would match)."""
    drafts = tmp_path / "drafts.json"
    run("benchmarks/adaptive_replay.py", "record", "--prompts", "2", "--max-new-tokens", "24", "--out", str(drafts))
    recorded = json.loads(drafts.read_text())
    assert len(recorded) == 2
    for request in recorded:
        assert len(request["output"]) == 24 and len(request["drafts"]) == len(request["confidence"]) >= 20
        assert all(len(d) == len(request["drafts"][0]) for d in request["drafts"][:-8])
        output, firsts = request["output"], [d[0] for d in request["drafts"]]
        assert sum(d == output[t + 1] for t, d in enumerate(firsts)) >= 0.3 * len(firsts)
        assert sum(d == output[t] for t, d in enumerate(firsts)) < 0.3 * len(firsts)
    out = run("benchmarks/adaptive_replay.py", "replay", "--drafts", str(drafts), "--set", "2", "--seeds", "2")
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows[0]["prompts"] == "0-1" and len(rows[0]["adaptive_vs_chain"]) == 2
    assert all(0.2 < r < 5.0 for r in rows[0]["adaptive_vs_chain"]) and rows[0]["chain_tokens_per_s"] > 0


def test_batch_trees_benchmark_compares_trees_and_chains_batched():
    """benchmarks/batch_trees.py on the shipped pair (smoke size): both arms batched, trees verified,
    the same tokens (or it exits 1). Without the batch plan, whose widths follow this host's timings
    (a loaded machine once chose widths that left no tree), every row drafts its whole room."""
    out = run("benchmarks/batch_trees.py", "--concurrency", "2", "--max-new-tokens", "24", "--repeats", "1",
              "--plan", "off")
    assert "c=2" in out and "tree/chain" in out and "MISMATCH" not in out, out
    trees = int(out.split(" trees)")[0].rsplit(", ", 1)[1])
    assert trees > 0, out


def test_tree_expected_benchmark_reports_paired_expected_acceptance():
    """benchmarks/tree_expected.py (smoke size): a tree of 16 holds the tree of 4 (the same heap's
    first pops), so its expected acceptance cannot be lower; the expectation itself equals what
    sample and match accepts on average (Monte Carlo on a fixed table)."""
    out = run("benchmarks/tree_expected.py", "--pair", "tiny", "--prompts", "1", "--max-new-tokens", "24",
              "--shape", 'small={"budget": 4}', "--shape", 'big={"budget": 16}')
    report = json.loads(out[out.index("{"):])
    assert report["cycles"] > 0 and report["chain_acceptance_length"] >= 1.0
    assert report["big"]["acceptance_length"] >= report["small"]["acceptance_length"] >= 1.0

    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from tree_expected import expected_drafts
    from test_tree import NP, TREE, target_logits

    from speculant.core.types import SamplingParams
    from speculant.verifiers.tree import tree_verify

    logits, rng = target_logits(), np.random.default_rng(0)
    probs = np.exp(logits.astype(np.float64))
    probs /= probs.sum(axis=1, keepdims=True)
    drawn = np.mean([tree_verify(NP, TREE, logits, SamplingParams(temperature=1.0), rng).accepted for _ in range(20000)])
    assert abs(expected_drafts(TREE, probs, list(range(TREE.size))) - drawn) < 0.02


def test_batch_long_benchmark_runs_a_long_request_beside_short_ones():
    """benchmarks/batch_long.py on the tiny pair (smoke size): both arms batched, every request equal
    to its single-stream run (or it exits 1), the long request's drafting reported."""
    out = run("benchmarks/batch_long.py", "--pair", "tiny", "--concurrency", "3", "--long", "40",
              "--max-new-tokens", "8", "--repeats", "1")
    assert "the first 1 ask 40 new tokens, the others 8" in out and "spec / plain" in out and "!!!" not in out, out
    assert "first long request: " in out and "drafts submitted" in out, out
