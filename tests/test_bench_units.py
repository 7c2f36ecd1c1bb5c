"""speculant bench without models: speed-up arithmetic, config parsing, matrix expansion, context scaling."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from speculant.bench import stats as S
from speculant.bench.config import BenchConfig
from speculant.bench.matrix import Cell, expand
from speculant.bench.summary import BenchSummary, cell_summary
from speculant.bench.workloads import build_prompt_ids, load_workload, parse_context_length, resolve_context_lengths
from speculant.core.errors import ConfigError


def run(role, repeat, decode_s, new_tokens, total_s=None, prefill_s=0.01, acceptance=()):
    return {"role": role, "repeat": repeat, "decode_s": decode_s, "new_tokens": new_tokens,
            "total_s": total_s if total_s is not None else decode_s + prefill_s, "prefill_s": prefill_s,
            "ttft_s": prefill_s, "prompt_tokens": 10, "acceptance_lengths": list(acceptance), "verify_steps": len(acceptance),
            "peak_memory_bytes": 1, "stop_reason": "max_new_tokens", "submitted_per_position": [],
            "accepted_per_position": [], "token_match": True if role == "spec" else None}


def test_tpot_excludes_the_first_token():
    assert S.tpot(1.0, 11) == pytest.approx(0.1)  # 10 tokens after the first in 1 s
    assert S.tpot(1.0, 1) is None and S.tpot(0.0, 5) is None


def test_speedup_is_plain_tpot_over_speculative_tpot_pooled_per_repeat_median_over_repeats():
    plain = [run("plain", 0, 1.0, 11), run("plain", 0, 2.0, 21),   # repeat 0: 3.0 s / 30 tokens = 0.1
             run("plain", 1, 1.2, 11), run("plain", 1, 2.4, 21)]   # repeat 1: 3.6 s / 30 = 0.12
    spec = [run("spec", 0, 0.5, 11), run("spec", 0, 1.0, 21),      # 1.5 / 30 = 0.05 -> 2.0x
            run("spec", 1, 0.3, 11), run("spec", 1, 0.6, 21)]      # 0.9 / 30 = 0.03 -> 4.0x
    assert S.pooled_tpot(plain[:2]) == pytest.approx(0.1)
    assert S.speedups_per_repeat(plain, spec) == pytest.approx([2.0, 4.0])
    assert S.median(S.speedups_per_repeat(plain, spec)) == pytest.approx(3.0)
    # pooling weights prompts by tokens: not the mean of per-prompt ratios
    skewed = [run("spec", 0, 0.1, 11), run("spec", 0, 2.0, 21)]  # 2.1 / 30 = 0.07
    assert S.speedups_per_repeat(plain[:2], skewed) == pytest.approx([0.1 / 0.07])


def test_speedup_ignores_repeats_missing_on_one_side_and_handles_no_decode():
    plain = [run("plain", 0, 1.0, 11), run("plain", 1, 1.0, 11)]
    spec = [run("spec", 0, 0.5, 11)]
    assert S.speedups_per_repeat(plain, spec) == pytest.approx([2.0])
    assert S.speedup(None, 0.1) is None and S.speedup(0.1, 0.0) is None
    assert S.speedups_per_repeat([run("plain", 0, 1.0, 1)], [run("spec", 0, 1.0, 1)]) == []


def test_end_to_end_speedup_uses_total_time():
    plain = [run("plain", 0, 1.0, 11, total_s=1.5)]
    spec = [run("spec", 0, 0.25, 11, total_s=0.75)]
    assert S.speedups_per_repeat(plain, spec, field="total") == pytest.approx([2.0])
    assert S.speedups_per_repeat(plain, spec) == pytest.approx([4.0])


def test_acceptance_conventions():
    runs = [run("spec", 0, 1, 8, acceptance=[3, 4]), run("spec", 0, 1, 8, acceptance=[1, 1, 1, 1])]
    assert S.mean_acceptance_length(runs) == pytest.approx((3.5 + 1.0) / 2)  # mean of per-run means
    runs[0].update(submitted_per_position=[2, 2, 1], accepted_per_position=[2, 1, 0])
    runs[1].update(submitted_per_position=[4, 4], accepted_per_position=[0, 0])
    submitted, accepted = S.pooled_positions(runs)
    assert (submitted, accepted) == ([6, 6, 1], [2, 1, 0])
    assert S.rates(submitted, accepted) == pytest.approx([2 / 6, 1 / 6, 0.0])


def _cell(**kw) -> Cell:
    data = {"key": "k", "target": "/t", "target_name": "t", "backend": {}, "drafter": "dflash", "draft_path": "/d",
            "block_size": 4, "verifier": "auto", "quantization": "off", "sampling": {}, "context": "0",
            "context_tokens": 0, "max_new_tokens": 11, "workload": "code"}
    data.update(kw)
    return Cell.model_validate(data)


def test_cell_summary_from_constructed_runs():
    plain = [run("plain", r, 1.0, 11) for r in range(3)]
    spec = [run("spec", r, t, 11, acceptance=[4, 4, 3]) for r, t in enumerate((0.5, 0.25, 0.4))]
    summary = cell_summary(_cell(), {"status": "ok", "attempt": "a"}, plain + spec)
    assert summary.speedup_per_repeat == pytest.approx([2.0, 4.0, 2.5])
    assert summary.speedup == pytest.approx(2.5)
    assert summary.plain.decode_tokens_per_s == pytest.approx(10.0)
    assert summary.spec.decode_tokens_per_s == pytest.approx(25.0)  # median of 20, 40, 25
    assert summary.token_match is True and summary.spec.mean_acceptance_length == pytest.approx(11 / 3)


def test_summary_schema_rejects_unknown_and_missing_fields():
    good = {"created": "x", "out": "o", "complete": True, "config": {}, "conditions": {}, "sessions": [],
            "notes": [], "totals": {}, "cells": []}
    BenchSummary.model_validate(good)
    with pytest.raises(Exception):
        BenchSummary.model_validate({**good, "surprise": 1})
    with pytest.raises(Exception):
        BenchSummary.model_validate({k: v for k, v in good.items() if k != "cells"})


# -- config ----------------------------------------------------------------------------------
def test_config_file_shorthands_and_relative_paths(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "one"}) + "\n" + json.dumps("two") + "\n")
    (tmp_path / "bench.toml").write_text(
        'target = "models/t"\ndraft = "models/d"\nout = "res"\n'
        '[matrix]\ndrafters = ["none", "dflash", {kind = "dflash2", path = "models/d2"}, "mtp"]\n'
        'backends = ["torch:cpu:float32", "mlx"]\nsampling = ["greedy", "T=0.7,p=0.9,k=20"]\n'
        'context_lengths = [0, "4k", "25%"]\nworkloads = ["code", "p.jsonl"]\n')
    cfg = BenchConfig.load(tmp_path / "bench.toml")
    assert cfg.targets[0].path == tmp_path / "models/t" and cfg.out == tmp_path / "res"
    kinds = [(d.kind, cfg.drafter_path(d)) for d in cfg.matrix.drafters]
    assert kinds == [("none", None), ("dflash", tmp_path / "models/d"), ("dflash2", tmp_path / "models/d2"),
                     ("mtp", None)]  # MTP reads its heads from the target folder by default
    by_kind = BenchConfig.load({"target": "t", "draft": {"dflash": "a", "dflash2": "b"},
                                "matrix": {"drafters": ["dflash", "dflash2", "mtp"]}})
    assert [by_kind.drafter_path(d) for d in by_kind.matrix.drafters] == [Path("a"), Path("b"), None]
    assert [b.label for b in cfg.matrix.backends] == ["torch:cpu:float32", "mlx:auto"]
    assert [s.label for s in cfg.matrix.sampling] == ["greedy", "T=0.7 p=0.9 k=20"]
    w = cfg.matrix.workloads[1]
    assert (w.name, w.path) == ("p", tmp_path / "p.jsonl")
    assert load_workload(w.name, w.path, None) == ["one", "two"]


@pytest.mark.parametrize("bad, field", [
    ({"matrix": {"block_sizes": [1]}}, "matrix.block_sizes"),
    ({"matrix": {"drafter": ["none"]}}, "matrix.drafter"),
    ({"matrix": {"context_lengths": ["lots"]}}, "matrix.context_lengths"),
    ({"matrix": {"sampling": ["hot"]}}, "matrix.sampling"),
    ({"repeats": 0}, "repeats"),
])
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        BenchConfig.load({"target": "t", **bad})


def test_context_lengths_parse_and_scale_to_the_window():
    assert parse_context_length("4k").tokens == 4096 and parse_context_length("25%").fraction == 0.25
    # 4K/8K/16K/32K on a 4096 window with 95 new tokens: scaled by one factor, ratios kept
    lengths = resolve_context_lengths([0, "4k", "8k", "16k", "32k"], 4096, 95)
    assert lengths["0"] == 0 and lengths["32k"] == 4000
    assert [lengths[k] for k in ("4k", "8k", "16k")] == [500, 1000, 2000]
    assert resolve_context_lengths(["50%"], 4096, 95) == {"50%": 2000}
    assert resolve_context_lengths(["4k", "1k"], 2048, 47, fit="skip") == {"4k": None, "1k": 1024}
    assert resolve_context_lengths(["4k"], None, 10) == {"4k": 4096}


def _target(tmp_path, window=512):
    t = tmp_path / "t"
    t.mkdir()
    (t / "config.json").write_text(json.dumps({"max_position_embeddings": window}))
    return t


def test_expand_collapses_plain_axes_and_keys_are_stable(tmp_path):
    cfg = BenchConfig.load({
        "target": str(_target(tmp_path)), "draft": str(tmp_path / "d"),
        "matrix": {"drafters": ["none", "dflash"], "block_sizes": [2, 4], "verifiers": ["auto", "greedy"],
                   "sampling": ["greedy"], "context_lengths": [0, "50%"], "max_new_tokens": [11],
                   "workloads": ["code"]}})
    cells, notes = expand(cfg)
    plain = [c for c in cells if c.is_plain]
    assert len(plain) == 2 and len(cells) == 2 + 2 * 2 * 2
    assert {c.context_tokens for c in cells} == {0, 250}
    assert [c.key for c in expand(cfg)[0]] == [c.key for c in cells]
    assert len({c.key for c in cells}) == len(cells)
    # the measurement protocol and the model fingerprint are part of the key
    assert expand(cfg.with_updates(repeats=5))[0][0].key != cells[0].key
    assert expand(cfg, {str(cfg.targets[0].path): "other"})[0][0].key != cells[0].key


def test_tree_budget_and_width_are_axes_of_the_tree_verifier_only(tmp_path):
    from speculant.bench.engines import engine_config

    target = _target(tmp_path)
    cfg = BenchConfig.load({
        "target": str(target), "draft": str(tmp_path / "d"),
        "matrix": {"drafters": ["dflash"], "block_sizes": [8], "verifiers": ["auto", "tree"],
                   "tree_budgets": [8, 32], "tree_widths": [2, 4], "sampling": ["greedy"], "max_new_tokens": [11],
                   "workloads": ["code"]}})
    cells, _ = expand(cfg)
    trees = [c for c in cells if c.verifier == "tree"]
    assert len(cells) == 5 and {(c.tree_budget, c.tree_width) for c in trees} == {(8, 2), (8, 4), (32, 2), (32, 4)}
    assert len({c.key for c in cells}) == 5 and "tree B32 K2" in {c.label.split(" | ")[2] for c in trees}
    auto = next(c for c in cells if c.verifier == "auto")
    assert auto.tree_budget is None and "tree_budget" not in auto.model_dump(exclude_none=True)
    config = engine_config(trees[-1], speculative=True).verifier
    assert config.kind == "tree" and config.options == {"budget": 32, "width": 4}
    assert engine_config(auto, speculative=True).verifier.options == {}
    with pytest.raises(Exception, match="tree budgets"):
        BenchConfig.load({"target": str(target), "matrix": {"tree_budgets": [0]}})


def test_expand_notes_scaled_context_lengths(tmp_path):
    cfg = BenchConfig.load({"target": str(_target(tmp_path, window=1024)), "matrix": {
        "drafters": ["none"], "context_lengths": ["4k", "8k"], "max_new_tokens": [23]}})
    cells, notes = expand(cfg)
    assert [c.context_tokens for c in cells] == [500, 1000] and all(c.context_scaled for c in cells)
    assert any("scaled" in n for n in notes)


class _Tok:
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) % 50 for ch in text]


def test_prompts_are_padded_to_the_context_length_before_the_prompt():
    tok = _Tok()
    ids = build_prompt_ids(tok, "hello", 300, None)
    assert len(ids) == 300 and ids[-5:] == tok.encode("hello")
    assert build_prompt_ids(tok, "hello", 0, None) == tok.encode("hello")
    assert build_prompt_ids(tok, "hello", 3, None) == tok.encode("hello")  # never cut the prompt


def test_prompt_files(tmp_path):
    (tmp_path / "a.txt").write_text("first\n---\nsecond\n")
    (tmp_path / "b.json").write_text(json.dumps([{"turns": ["t1", "t2"]}, {"question": "q"}]))
    assert load_workload("a", tmp_path / "a.txt", None) == ["first", "second"]
    assert load_workload("dir", tmp_path, None) == ["first", "second", "t1", "q"]
    with pytest.raises(ConfigError, match="does not exist"):
        load_workload("x", tmp_path / "missing.jsonl", None)
    with pytest.raises(ConfigError, match="unknown built-in"):
        load_workload("nope", None, None)


def test_mlx_cells_ask_pytorch_openmp_workers_to_sleep(monkeypatch):
    import sys

    from speculant.bench.runner import quiet_openmp

    both = BenchConfig.load({"target": "t", "matrix": {"backends": ["torch:cpu", "mlx"]}})
    torch_only = BenchConfig.load({"target": "t", "matrix": {"backends": ["torch:cpu"]}})
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert quiet_openmp(torch_only) is None and "OMP_WAIT_POLICY" not in os.environ
    assert quiet_openmp(both) is None and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setitem(os.environ, "OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice stands
    assert quiet_openmp(both) is None and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setitem(sys.modules, "torch", object())  # imported already: too late, say so
    note = quiet_openmp(both)
    assert "OMP_WAIT_POLICY=PASSIVE" in note and "OMP_WAIT_POLICY" not in os.environ
