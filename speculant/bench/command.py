"""``speculant bench``: the argument parser and command, plugged into ``speculant.cli``.

Flags override the config file; list flags take comma-separated values
(``--block-sizes 3,5,8``, ``--drafter none,dflash``); ``--sampling`` takes ``;``-separated
settings (``"greedy;T=0.7,p=0.95,k=20"``). Exit status: 0 when every cell finished or was
skipped as invalid (reasons in the table), 1 when a cell failed, 2 for a bad config, 130 when
interrupted (finished cells are kept; the same command continues).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from speculant.api import plugin_registry
from speculant.bench.config import BenchConfig
from speculant.bench.runner import BenchInterrupted, run_bench
from speculant.core.errors import ConfigError

INTERRUPTED_EXIT = 130
TINY_PAIR_VERSION = "v1"

# A first look in a few minutes on a laptop CPU: plain vs DFlash at three block sizes, greedy
# and one sampling setting, two code prompts, 64 new tokens, 2 repeats.
QUICK: dict[str, Any] = {
    "repeats": 2, "warmup": 1, "prompts_per_workload": 2,
    "matrix": {"drafters": ["none", "dflash"], "block_sizes": [3, 5, 8],
               "sampling": ["greedy", "T=0.8,p=0.95,k=20"], "context_lengths": [0], "max_new_tokens": [64],
               "workloads": ["code"]},
}


def add_parser(sub: Any, parents: list[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", parents=parents or [], help="A/B benchmark matrix: plain vs speculative decoding",
                       description="Run a benchmark matrix (plain vs speculative decoding, interleaved, with repeats) "
                                   "and write raw JSONL, a summary JSON, a Markdown table and PNG plots.")
    p.add_argument("--config", metavar="FILE", help="bench config (.toml, .yaml, .json); flags override it")
    p.add_argument("--quick", action="store_true",
                   help="a small preset matrix on the default model (a tiny test pair when none is available)")
    p.add_argument("--reference", action="store_true",
                   help="add the reference dflash loop and transformers DFlash columns where they can run")
    p.add_argument("--pair", metavar="NAME",
                   help="with --quick: the named model pair (tiny, smollm2; default tiny, whose drafters the "
                        "matrix compares: none is trained for smollm2 yet)")
    g = p.add_argument_group("matrix (comma-separated lists)")
    g.add_argument("--target", metavar="DIR", help="target model folder")
    g.add_argument("--draft", metavar="DIR", help="draft checkpoint folder for drafters without their own path")
    g.add_argument("--drafter", metavar="KINDS", help="drafter kinds, e.g. none,dflash")
    g.add_argument("--block-sizes", metavar="LIST", help="runtime block sizes, e.g. 3,5,8")
    g.add_argument("--max-new-tokens", metavar="LIST", help="e.g. 256,1024")
    g.add_argument("--context-lengths", metavar="LIST", help="prompt lengths: 0 (bare), 4096, 4k, 25%% of the window")
    g.add_argument("--workloads", metavar="LIST", help="built-in names (code, math, chat) or prompt files")
    g.add_argument("--sampling", metavar="LIST", help="';'-separated: greedy;T=0.7,p=0.95,k=20")
    g.add_argument("--verifiers", metavar="LIST", help="auto, greedy, speculative_sampling, ...")
    g.add_argument("--tree-budgets", metavar="LIST", help="with the tree verifier: nodes per tree, e.g. 8,32")
    g.add_argument("--tree-widths", metavar="LIST", help="with the tree verifier: candidates per depth, e.g. 2,4")
    g.add_argument("--quantization", metavar="LIST", help="draft quantization: off, w4, w8:gs32, ...")
    g.add_argument("--backend", metavar="LIST", help="kind[:device[:dtype]], e.g. torch:cpu:float32,mlx")
    m = p.add_argument_group("measurement and output")
    m.add_argument("--repeats", type=int, metavar="N")
    m.add_argument("--warmup", type=int, metavar="N")
    m.add_argument("--prompts", type=int, metavar="N", help="prompts per workload")
    m.add_argument("--threads", type=int, metavar="N", help="torch intra-op threads")
    m.add_argument("--seed", type=int, metavar="N")
    m.add_argument("--out", metavar="DIR", help="output folder (an existing run there is continued)")
    m.add_argument("--fresh", action="store_true", help="discard earlier results in the output folder")
    m.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    m.add_argument("--stop-after-runs", type=int, metavar="N", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)
    return p


def _split(text: str | None, sep: str = ",") -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(sep) if t.strip()]


def _ints(text: str | None) -> list[int] | None:
    items = _split(text)
    try:
        return None if items is None else [int(t) for t in items]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None


def build_config(args: argparse.Namespace, say=print) -> BenchConfig:
    data: dict[str, Any] = BenchConfig.load(args.config).model_dump() if args.config else {}
    if args.quick:
        data = _merge(data, QUICK) if not args.config else data
        data.setdefault("out", "bench-out/quick")
    matrix: dict[str, Any] = dict(data.get("matrix") or {})
    axes = {"drafters": _split(args.drafter), "block_sizes": _ints(args.block_sizes),
            "max_new_tokens": _ints(args.max_new_tokens), "context_lengths": _split(args.context_lengths),
            "workloads": _split(args.workloads), "sampling": _split(args.sampling, ";"),
            "verifiers": _split(args.verifiers), "quantization": _split(args.quantization),
            "backends": _split(args.backend), "tree_budgets": _ints(args.tree_budgets),
            "tree_widths": _ints(args.tree_widths)}
    matrix.update({k: v for k, v in axes.items() if v is not None})
    data["matrix"] = matrix
    if matrix.get("context_lengths"):
        matrix["context_lengths"] = [int(c) if str(c).isdigit() else c for c in matrix["context_lengths"]]
    for flag, key in (("repeats", "repeats"), ("warmup", "warmup"), ("prompts", "prompts_per_workload"),
                      ("threads", "threads"), ("seed", "seed"), ("out", "out"), ("draft", "draft")):
        if getattr(args, flag) is not None:
            data[key] = getattr(args, flag)
    if args.target:
        data.pop("targets", None)
        data["target"] = args.target
    if args.reference:
        data["reference"] = True
    if args.no_plots:
        data["plots"] = False
    if not data.get("targets") and not data.get("target"):
        if not args.quick:
            raise ConfigError("no model given: pass --config bench.toml, --target MODEL_DIR, or --quick")
        target, draft = default_pair(say, args.pair or "tiny")
        if not draft and args.drafter is None:  # a pair with no drafters yet: plain decoding only
            matrix["drafters"] = ["none"]
        data["target"] = str(target)
        data["draft"] = data.get("draft") or (str(draft) if isinstance(draft, Path) else {k: str(v) for k, v in draft.items()})
    return BenchConfig.load(data)


def _merge(base: dict, preset: dict) -> dict:
    out = {**preset, **{k: v for k, v in base.items() if k != "matrix"}}
    out["matrix"] = {**preset.get("matrix", {}), **(base.get("matrix") or {})}
    return out


def default_pair(say=print, pair: str = "tiny") -> tuple[Path, Path | dict[str, Path]]:
    """The default (target, draft) for --quick: the model pair shipped with speculant (a draft
    folder per drafter kind), or the named ``pair`` (pulled on first use). Where an install lacks
    the shipped pair, a tiny random Qwen3 target and DFlash draft with a planted shared bias, built
    once under $XDG_CACHE_HOME/speculant; their numbers exercise the pipeline, not a real model."""

    from speculant import embedded, pairs

    if pair != "tiny":
        paths = pairs.ensure_pair(pair, say=say)
        return paths.target, paths.drafters

    if embedded.available():
        return embedded.PAIR_DIR / "target", {kind: embedded.PAIR_DIR / kind for kind in embedded.DRAFTERS}
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "speculant" / f"bench-tiny-pair-{TINY_PAIR_VERSION}"
    target, draft = cache / "target", cache / "draft"
    marker = cache / "complete"
    say("speculant bench: no default model pair is available (the shipped pair is missing from this install); "
        f"using a tiny random planted test pair at {cache}. Its numbers exercise the benchmark, "
        "they say nothing about real models.")
    if not marker.is_file():
        from speculant.testing import tiny  # needs torch + transformers: only here

        tiny.build_tiny_target(target, seed=0, planted=8.0)
        tiny.build_tiny_dflash(draft, target, seed=7, block_size=16)
        marker.write_text("ok\n")
    return target, draft


def cmd_bench(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(text, file=sys.stderr)

    config = build_config(args, say)
    registry = plugin_registry(getattr(args, "plugin", None) or ())
    try:
        summary = run_bench(config, registry=registry, progress=not args.no_progress, fresh=args.fresh,
                            stop_after_runs=args.stop_after_runs)
    except (BenchInterrupted, KeyboardInterrupt) as exc:
        say(f"speculant bench: interrupted ({exc or 'Ctrl-C'}); finished cells are kept in {config.out}; "
            "run the same command again to continue")
        return INTERRUPTED_EXIT
    table = (Path(config.out) / "summary.md").read_text(encoding="utf-8")
    print(table)
    t = summary.totals
    say(f"speculant bench: {t['ok']} cells ok, {t['skipped']} skipped, {t['failed']} failed, {t['runs']} runs; "
        f"results in {config.out}")
    return 0 if t["failed"] == 0 else 1
