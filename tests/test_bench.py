"""speculant bench end to end on tiny real models: artefacts, schema, plots, resume, CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from speculant.bench import BenchConfig, BenchInterrupted, BenchSummary, run_bench

pytest.importorskip("matplotlib")

MINI = {"name": "mini", "prompts": ["def add(a, b):\n", "for i in range(3):\n"]}


def config(pair, out, **kw):
    data = {"target": str(pair["target"]), "draft": str(pair["draft"]), "out": str(out), "repeats": 2, "warmup": 1,
            "warmup_tokens": 4, "prompts_per_workload": 1,
            "matrix": {"drafters": ["none", "dflash"], "block_sizes": [2, 4], "backends": ["torch:cpu:float32"],
                       "sampling": ["greedy"], "context_lengths": [0], "max_new_tokens": [8], "workloads": [MINI]}}
    matrix = kw.pop("matrix", {})
    data.update(kw)
    data["matrix"].update(matrix)
    return BenchConfig.load(data)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def matrix_run(planted_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    cfg = config(planted_pair, out, matrix={"sampling": ["greedy", "T=1.0"], "context_lengths": [0, 64],
                                            "workloads": [MINI, "code"]})
    seen: list[dict] = []
    summary = run_bench(cfg, progress=False, on_run=seen.append)
    return cfg, out, summary, seen


def test_tiny_matrix_produces_every_artefact(matrix_run):
    cfg, out, summary, seen = matrix_run
    for name in ("runs.jsonl", "cells.jsonl", "manifest.json", "summary.json", "summary.md"):
        assert (out / name).is_file(), name
    # 2 workloads x 2 sampling x 2 contexts: 8 plain cells and 16 speculative cells (blocks 2, 4)
    assert summary.complete and summary.totals["ok"] == 24 and summary.totals["failed"] == 0
    runs = lines(out / "runs.jsonl")
    assert runs == seen and all(r["type"] == "run" for r in runs)
    assert len(runs) == 8 * 2 + 16 * 2 * 2  # repeats x prompts x (plain [+ spec])
    per_cell = Counter((r["cell"], r["role"]) for r in runs)
    assert set(per_cell.values()) == {2}
    table = (out / "summary.md").read_text()
    assert table.count("\n| mini |") == 12 and table.count("\n| code |") == 12 and "speed-up" in table


def test_runs_record_the_metrics_and_greedy_token_match(matrix_run):
    _, _, summary, runs = matrix_run
    fields = {"ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "total_s", "mean_acceptance_length",
              "per_position_acceptance", "verify_steps", "peak_memory_bytes", "new_tokens", "stop_reason", "tpot_s",
              "tokens_sha"}
    assert all(fields <= set(r) for r in runs)
    spec = [r for r in runs if r["role"] == "spec"]
    greedy = {c.key for c in summary.cells if c.params.sampling.is_greedy}
    assert all(r["token_match"] is True for r in spec if r["cell"] in greedy)  # lossless, token for token
    assert all(r["token_match"] is None for r in spec if r["cell"] not in greedy)
    assert all(r["new_tokens"] == 8 and r["stop_reason"] == "max_new_tokens" for r in runs)
    # A/B interleaved: within a cell the order of plain and speculative alternates between repeats
    orders = {(r["cell"], r["repeat"]): r["order"] for r in spec}
    assert {orders[(k, 0)] != orders[(k, 1)] for k in {r["cell"] for r in spec}} == {True}


def test_tree_is_a_verifier_axis_with_its_statistics_in_the_runs(planted_pair, tmp_path):
    cfg = config(planted_pair, tmp_path / "out", repeats=1,
                 matrix={"drafters": ["dflash"], "block_sizes": [4], "verifiers": ["auto", "tree"]})
    runs: list[dict] = []
    summary = run_bench(cfg, progress=False, on_run=runs.append)
    assert summary.totals["ok"] == 2 and summary.totals["failed"] == 0
    spec = [r for r in runs if r["role"] == "spec"]
    trees = [r for r in spec if "tree" in r]
    assert len(trees) == 1 and len(spec) == 2
    assert trees[0]["token_match"] is True and trees[0]["tree"]["trees"] > 0
    assert trees[0]["tree"]["nodes_verified"] > trees[0]["tree"]["trees"]


def test_summary_json_validates_and_holds_the_numbers(matrix_run):
    _, out, summary, _ = matrix_run
    loaded = BenchSummary.model_validate_json((out / "summary.json").read_text())
    assert loaded == summary
    c = loaded.conditions
    assert {"packages", "machine", "threads", "models", "settings"} <= set(c)
    assert "torch" in c["packages"] and c["threads"].get("torch_num_threads")
    assert all(len(h) == 64 for h in c["models"].values())
    for cell in loaded.cells:
        assert cell.plain.runs == 2 and cell.plain.decode_tokens_per_s > 0
        if cell.params.is_plain:
            assert cell.spec is None and cell.speedup is None
            continue
        assert cell.block_size_used == cell.params.block_size
        assert cell.speedup > 0 and len(cell.speedup_per_repeat) == 2
        assert cell.spec.mean_acceptance_length >= 1
        assert len(cell.spec.per_position_acceptance) == cell.params.block_size - 1
        assert cell.token_match is (True if cell.params.sampling.is_greedy else None)
        assert cell.reference is None  # --reference not asked
    assert [c.params.context_tokens for c in loaded.cells[:2]] == [0, 64]


def test_plots_are_png_files_with_the_expected_series(matrix_run):
    from matplotlib.image import imread

    _, out, summary, _ = matrix_run
    plots = {p.name: p for p in summary.plots}
    assert set(plots) == {"acceptance_by_position", "speedup_vs_block_size", "context_length", "workloads"}
    for p in plots.values():
        data = (out / p.file).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
        pixels = imread(out / p.file)
        assert pixels.shape[0] > 200 and pixels.std() > 0.01  # not a blank image
    spec_labels = {"dflash b2 greedy", "dflash b4 greedy", "dflash b2 T=1", "dflash b4 T=1"}
    acc = plots["acceptance_by_position"].series
    assert {s.label for s in acc} == spec_labels
    assert all(s.x == list(range(1, int(s.label.split()[1][1:]))) for s in acc)
    speed = plots["speedup_vs_block_size"].series
    assert {s.label for s in speed} == {"dflash greedy", "dflash T=1"} and all(s.x == [2, 4] for s in speed)
    ctx = plots["context_length"].series
    assert {s.panel for s in ctx} == {"decode tok/s", "mean acceptance length"}
    assert {s.label for s in ctx if s.panel == "decode tok/s"} == spec_labels | {"plain greedy", "plain T=1"}
    assert all(s.x == [0, 64] and None not in s.y for s in ctx)
    work = plots["workloads"].series
    assert {s.label for s in work} == spec_labels | {"plain"} and all(s.x == ["code", "mini"] for s in work)


def test_figures_draw_one_line_per_series(matrix_run):
    from speculant.bench.plots import build_figures

    _, _, summary, _ = matrix_run
    for fig, info in build_figures(summary):
        axes = fig.get_axes()
        if info.name == "workloads":
            assert len(axes[0].containers) == len(info.series)  # one bar group per series
        else:
            assert sum(len(ax.get_lines()) for ax in axes) >= len(info.series)
            assert {line.get_label() for ax in axes for line in ax.get_lines()} >= {s.label for s in info.series}


def test_interrupted_run_resumes_without_repeating_cells(planted_pair, tmp_path):
    cfg = config(planted_pair, tmp_path / "out", matrix={"block_sizes": [2, 4, 32]})
    # cells in order: plain (2 runs), b2 (4 runs), b4 (4 runs), b32 (skipped: above the trained 16)
    first: list[dict] = []
    with pytest.raises(BenchInterrupted):
        run_bench(cfg, progress=False, stop_after_runs=8, on_run=first.append)
    partial = BenchSummary.model_validate_json((tmp_path / "out" / "summary.json").read_text())
    assert not partial.complete and partial.totals["ok"] == 2 and partial.totals["pending"] == 2
    done = {c.key for c in partial.cells if c.status == "ok"}

    second: list[dict] = []
    summary = run_bench(cfg, progress=False, on_run=second.append)
    assert not done & {r["cell"] for r in second}  # finished cells were not measured again
    assert len(second) == 4  # the interrupted b4 cell, from its start
    assert summary.complete and summary.totals == {"ok": 3, "skipped": 1, "failed": 0, "pending": 0, "runs": 10}
    skipped = next(c for c in summary.cells if c.status == "skipped")
    assert skipped.params.block_size == 32 and "trained block size" in skipped.reason
    b4 = next(c for c in summary.cells if c.params.block_size == 4)
    assert b4.plain.runs == 2 and b4.spec.runs == 2  # the stale partial attempt is ignored
    assert len(lines(tmp_path / "out" / "runs.jsonl")) == 12  # ... but kept in the raw log
    assert len(json.loads((tmp_path / "out" / "manifest.json").read_text())["sessions"]) == 2

    third: list[dict] = []
    run_bench(cfg, progress=False, on_run=third.append)
    assert third == []  # nothing left to do


def test_reference_column_reports_why_it_cannot_run(planted_pair, tmp_path, monkeypatch):
    import speculant.bench.runner as runner

    monkeypatch.setattr(runner, "find_reference_runner", lambda: (None, "no reference here (test)"))
    cfg = config(planted_pair, tmp_path / "out", reference=True, repeats=1, warmup=0,
                 matrix={"block_sizes": [2]})
    summary = run_bench(cfg, progress=False)
    spec = next(c for c in summary.cells if not c.params.is_plain)
    assert spec.reference.status == "unavailable" and spec.reference.reason == "no reference here (test)"
    assert spec.transformers.status == "unavailable" and "speculation_type" in spec.transformers.reason
    assert any(n.startswith("transformers column") for n in summary.notes)


@pytest.mark.reference
def test_reference_column_runs_the_reference_loop(planted_pair, tmp_path):
    from speculant.bench.reference import find_reference_runner

    if find_reference_runner()[0] is None:
        pytest.skip(find_reference_runner()[1])
    cfg = config(planted_pair, tmp_path / "out", reference=True, repeats=1, warmup=0,
                 matrix={"drafters": ["dflash"], "block_sizes": [4]})
    summary = run_bench(cfg, progress=False)
    ref = summary.cells[0].reference
    assert ref.status == "ok", ref.reason
    assert ref.token_match is True and ref.ratio > 0
    assert ref.mean_acceptance_length == pytest.approx(summary.cells[0].spec.mean_acceptance_length)


def test_cli_bench_command(planted_pair, tmp_path, capsys):
    cli = pytest.importorskip("speculant.cli")
    if "bench" not in cli.build_parser().format_help():
        pytest.skip("the CLI has no bench subcommand yet")
    out = tmp_path / "out"
    rc = cli.main(["bench", "--target", str(planted_pair["target"]), "--draft", str(planted_pair["draft"]),
                   "--drafter", "none,dflash", "--block-sizes", "3", "--max-new-tokens", "6", "--repeats", "1",
                   "--warmup", "0", "--prompts", "1", "--workloads", "chat", "--backend", "torch:cpu:float32",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| chat | dflash | 3 |" in printed
    assert (out / "plots" / "speedup_vs_block_size.png").is_file()


def test_quick_uses_the_shipped_pair_with_a_draft_per_kind(tmp_path):
    import argparse

    from speculant import embedded
    from speculant.bench.command import add_parser, build_config

    if not embedded.available():
        pytest.skip("the shipped pair is not in this checkout")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--quick", "--out", str(tmp_path / "out"), "--no-progress"])
    said: list[str] = []
    cfg = build_config(args, said.append)
    assert said == [] and cfg.targets[0].path == embedded.PAIR_DIR / "target"
    for drafter in cfg.matrix.drafters:
        expected = None if not drafter.enabled else embedded.PAIR_DIR / drafter.kind
        assert cfg.drafter_path(drafter) == expected


def test_quick_falls_back_to_a_tiny_pair(tmp_path, monkeypatch, torch_threads):
    from speculant import embedded
    from speculant.bench.command import QUICK, add_parser, build_config

    import argparse

    monkeypatch.setattr(embedded, "PAIR_DIR", tmp_path / "no-shipped-pair")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--quick", "--out", str(tmp_path / "out"), "--no-progress"])
    said: list[str] = []
    cfg = build_config(args, said.append)
    assert "no default model pair" in said[0]
    assert cfg.targets[0].path == tmp_path / "cache" / "speculant" / "bench-tiny-pair-v1" / "target"
    assert [b for b in cfg.matrix.block_sizes] == QUICK["matrix"]["block_sizes"]
    with pytest.raises(BenchInterrupted):  # it runs; two runs are enough to show it
        run_bench(cfg, progress=False, stop_after_runs=2)
