"""Batched generation against plain batched decoding and today's single stream (issue #39's goals).

For each concurrency c, c different prompts (a fixed list of code prompts, cycled, each copy
after the first made different by a leading comment line) are generated, greedy, by these arms,
run in one process, their order reversed every other repeat (machine drift hits them alike):

- ``spec``: speculative batched, ``engine.run_many(prompts, max_batch=c)``;
- ``plain``: plain batched decoding of the same target, ``engine.without_drafter().run_many(...)``;
- ``single``: today's server (one request at a time, FIFO), ``engine.run(p)`` for each prompt;
- ``spec_flat``, ``plain_flat`` (asked for with ``--arms``): ``spec`` and ``plain`` with the flattened
  batch layout (``engine.batch_layout = "flat"``, PyTorch; docs/batching.md), an engine of their own.

At c = 1 every arm runs ``--solo-prompts`` prompts one after another, one call each, so ``spec``
is a batch of one through the scheduler and spec / single is the batch of one against
``engine.run`` (issue goal: within 3 %). Aggregate tokens/s = all new tokens / wall seconds of
the arm (and per CPU second of this process, steadier on a shared machine). Reported: medians
over ``--repeats`` of tokens/s and of the ratios within a repeat (spec / plain, spec / single),
the mean acceptance per request (spec and single), each batched arm's batched forwards and the
tokens they computed, padding included (``forwards/tokens``: where two arms did the same work, a
difference in their speed is the machine's), and how many requests' tokens differ from their
single-stream run (spec and plain; printed loudly, must be 0).
One warm-up of every arm before timing, and of the batched arms at each concurrency (4 new tokens:
the first batch of that many rows pays one-time costs, which went to whichever arm ran first).

    python benchmarks/batch_generate.py [--backend torch|mlx] [--config FILE | --mid 1024,8 [--family F] | --pair NAME]
        [--concurrency 1,4,16,32] [--max-new-tokens 64] [--repeats 3] [--threads 1] [--out FILE.json]

``--config`` takes an engine config file (default: the shipped tiny pair, its default drafter, lookup
and verifier); ``--pair smollm2`` the default pair as ``speculant generate`` runs it (prompt lookup
alone until its drafters ship); ``--mid H,L`` builds a random Qwen3 of hidden H x L layers with a planted DFlash
draft (benchmarks/fast_path.py's mid pair; ``--family qwen3_5`` a Gated DeltaNet hybrid of that size). ``--arms single --concurrency 1`` times ``engine.run``
alone, which also runs against older checkouts (PYTHONPATH=<old tree>) to compare the batch of
one with the loop before the scheduler (docs/batching.md says how).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Point:\n    def __init__(self, x, y):\n",
    "for i in range(10):\n",
    "def read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n",
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
    "def merge(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n",
    "from collections import defaultdict\n\ncounts = defaultdict(int)\nfor word in words:\n",
    "class Error(Exception):\n    \"\"\"Base class for errors in this module.\"\"\"\n\n",
    "if __name__ == '__main__':\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=__doc__)\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "import re\n\n_pattern = re.compile(r'",
]
ARMS = ("spec", "plain", "single", "spec_flat", "plain_flat")
DEFAULT_ARMS = ("spec", "plain", "single")
RATIOS = (("spec", "plain"), ("spec", "single"), ("spec_flat", "spec"), ("plain_flat", "plain"), ("spec_flat", "plain_flat"))


def prompts_for(count: int) -> list[str]:
    """``count`` different prompts: the list cycled, later rounds behind a ``# request i`` line."""
    return [PROMPTS[i % len(PROMPTS)] if i < len(PROMPTS) else f"# request {i}\n{PROMPTS[i % len(PROMPTS)]}"
            for i in range(count)]


def engine_config(args: argparse.Namespace, tmp: Path) -> dict:
    from speculant import embedded
    from speculant.core.config import EngineConfig

    if args.config:
        config = EngineConfig.load(args.config).model_dump(mode="json")
        if args.backend:
            config["backend"]["kind"] = args.backend
        return config
    if args.mid:
        from fast_path import mid_pair

        hidden, layers = (int(x) for x in args.mid.split(","))
        target, draft, _ = mid_pair(tmp, hidden, layers, 1, family=args.family)
        return {"backend": {"kind": args.backend or "torch", "dtype": "float32"}, "target": {"path": str(target)},
                "drafter": {"kind": "dflash", "path": str(draft)}, "verifier": {"kind": "adaptive"}}
    if args.pair:
        from speculant.pairs import engine_config as pair_config

        return pair_config(args.pair, backend=args.backend or "torch")
    return embedded.engine_config(backend=args.backend or "torch")


def describe(args: argparse.Namespace) -> str:
    mid = f"mid {args.mid}" + ("" if args.family == "qwen3" else f" {args.family}")
    return args.config or (mid if args.mid else f"pair {args.pair}" if args.pair else "shipped pair")


def run_arm(arm: str, engines: dict, prompts: list[str], c: int, n: int) -> tuple[float, float, list]:
    """Wall seconds, CPU seconds of this process and per-prompt results of one arm over ``prompts``."""
    groups = [[p] for p in prompts] if c == 1 else [prompts]
    start, cpu = time.perf_counter(), time.process_time()
    if arm == "single":
        results = [engines["spec"].run(p, max_new_tokens=n, temperature=0.0) for p in prompts]
    else:
        results = [r for g in groups for r in engines[arm].run_many(g, max_new_tokens=n, max_batch=len(g),
                                                                    temperature=0.0)]
    return time.perf_counter() - start, time.process_time() - cpu, results


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(engines: dict, arms: list[str], c: int, args: argparse.Namespace) -> dict:
    prompts = prompts_for(args.solo_prompts if c == 1 else c)
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu_rates: dict[str, list[float]] = {arm: [] for arm in arms}
    ratios: dict[str, list[float]] = {}
    mismatches = {arm: 0 for arm in arms if arm != "single"}
    acceptance: dict[str, list[float]] = {"spec": [], "single": []}
    batched_cycles: list[int] = []
    work: dict[str, list[tuple[int, int]]] = {arm: [] for arm in arms if arm != "single"}
    # untimed: what a process's first batch of c rows costs once is paid by neither arm's repeats
    for arm in work if c > 1 else ():
        run_arm(arm, engines, prompts, c, min(4, args.max_new_tokens))
    for repeat in range(args.repeats):
        results = {}
        for arm in (arms if repeat % 2 == 0 else arms[::-1]):
            plan = engines[arm].batch_plan if arm in work else None
            before = (plan.cycles, plan.computed) if plan else None
            seconds, cpu, results[arm] = run_arm(arm, engines, prompts, c, args.max_new_tokens)
            if plan:
                work[arm].append((plan.cycles - before[0], plan.computed - before[1]))
            tokens = sum(r.stats.new_tokens for r in results[arm])
            rates[arm].append(tokens / seconds)
            cpu_rates[arm].append(tokens / cpu)
        for arm, other in RATIOS:
            if arm in rates and other in rates:
                ratios.setdefault(f"{arm}_over_{other}", []).append(rates[arm][-1] / rates[other][-1])
                ratios.setdefault(f"{arm}_over_{other}_cpu", []).append(cpu_rates[arm][-1] / cpu_rates[other][-1])
        for arm in ("spec", "plain", "spec_flat", "plain_flat"):
            if arm not in results or "single" not in results:
                continue
            for i, (got, solo) in enumerate(zip(results[arm], results["single"])):
                if got.token_ids != solo.token_ids:
                    mismatches[arm] += 1
                    print(f"!!! MISMATCH {arm} c={c} prompt {i} {prompts[i]!r}: first difference at token "
                          f"{first_difference(got.token_ids, solo.token_ids)} ({len(got.token_ids)} vs "
                          f"{len(solo.token_ids)} tokens)", flush=True)
        if repeat == 0:
            for arm in ("spec", "single"):
                acceptance[arm] = [r.stats.mean_acceptance_length for r in results.get(arm, [])]
            batched_cycles = [r.stats.batched_cycles for r in results.get("spec", [])]
    row = {"concurrency": c, "requests": len(prompts)}
    row.update({f"{arm}_tok_s": statistics.median(v) for arm, v in rates.items()})
    row.update({f"{arm}_cpu_tok_s": statistics.median(v) for arm, v in cpu_rates.items()})
    row.update({k: statistics.median(v) for k, v in ratios.items() if v})
    row.update({f"{arm}_mismatches": m for arm, m in mismatches.items()})
    row.update({f"{arm}_mean_acceptance": statistics.fmean(v) for arm, v in acceptance.items() if v})
    row["spec_batched_cycles_mean"] = statistics.fmean(batched_cycles) if batched_cycles else 0.0
    for arm, done in work.items():  # the work each arm's batched forwards did: the same work should take the same time
        row[f"{arm}_forwards"] = statistics.median(n for n, _ in done)
        row[f"{arm}_computed_tokens"] = statistics.median(t for _, t in done)
    row["per_repeat_tok_s"], row["per_repeat_cpu_tok_s"] = rates, cpu_rates
    return row


def print_row(row: dict) -> None:
    parts = [f"c={row['concurrency']:<3}"]
    parts += [f"{arm} {row[f'{arm}_tok_s']:7.1f} tok/s" for arm in ARMS if f"{arm}_tok_s" in row]
    parts += [f"{k.replace('_over_', '/')} {row[k]:.3f}x (cpu {row[k + '_cpu']:.3f}x)"
              for k in (f"{a}_over_{b}" for a, b in RATIOS) if k in row]
    parts += [f"acceptance spec {row['spec_mean_acceptance']:.2f}"] if "spec_mean_acceptance" in row else []
    parts += [f"single {row['single_mean_acceptance']:.2f}"] if "single_mean_acceptance" in row else []
    parts += ["forwards/tokens " + " ".join(f"{arm} {row[f'{arm}_forwards']:g}/{row[f'{arm}_computed_tokens']:g}"
                                             for arm in ARMS if f"{arm}_forwards" in row)]
    parts += [f"mismatches " + "/".join(str(row.get(f"{arm}_mismatches", 0)) for arm in ARMS if arm != "single")]
    print("  ".join(parts), flush=True)


def commit() -> str:
    import speculant

    where = Path(speculant.__file__).resolve().parents[1]
    done = subprocess.run(["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "mlx"), help="default: the config's (torch for the pairs)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="engine config file; default: the shipped pair")
    source.add_argument("--mid", metavar="HIDDEN,LAYERS", help="a random planted Qwen3 pair of this size instead")
    source.add_argument("--pair", metavar="NAME", help="a named pair (smollm2: the default pair), its default drafter")
    parser.add_argument("--family", default="qwen3",
                        help="--mid: the target's family (tiny_families: qwen3_5 is a Gated DeltaNet hybrid)")
    parser.add_argument("--concurrency", default="1,4,16,32", help="comma-separated request counts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--solo-prompts", type=int, default=8, help="prompts run one by one at concurrency 1")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch intra-op threads")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                        help=f"comma-separated subset of {','.join(ARMS)} (the _flat arms: the flattened batch layout, PyTorch)")
    parser.add_argument("--out", metavar="FILE", help="write the results as JSON here")
    args = parser.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms: unknown arm {unknown[0] if unknown else '(none)'}; choose from {', '.join(ARMS)}")
    try:
        levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: give comma-separated whole numbers, got {args.concurrency!r}")
    if any(c < 1 for c in levels) or args.repeats < 1 or args.max_new_tokens < 1 or args.solo_prompts < 1:
        parser.error("--concurrency, --repeats, --max-new-tokens and --solo-prompts must be at least 1")
    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    from speculant.api import load_engine

    with tempfile.TemporaryDirectory() as tmp:
        config = engine_config(args, Path(tmp))
        engine = load_engine(config)
        engines = {"spec": engine, "plain": engine.without_drafter()}
        if any(arm.endswith("_flat") for arm in arms):  # an engine of its own: its own batch plan
            flat = load_engine(config)
            engines.update(spec_flat=flat, plain_flat=flat.without_drafter())
            for each in (flat, engines["plain_flat"]):
                each.batch_layout = "flat"
        warm = prompts_for(2)
        for arm in arms:  # warm-up: every arm once, batched where it batches
            run_arm(arm, engines, warm, 2, 8)
        print(f"{config['backend']['kind']} / {describe(args)}: "
              f"commit {commit()}, threads {args.threads}, {args.max_new_tokens} new tokens, {args.repeats} repeats, "
              f"load average {os.getloadavg()[0]:.2f}", flush=True)
        rows = []
        for c in levels:
            rows.append(measure(engines, arms, c, args))
            print_row(rows[-1])
    report = {"backend": config["backend"]["kind"], "pair": describe(args),
              "layer_types": sorted(set(engine.target.info.layer_types)),
              "commit": commit(), "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "load_average": os.getloadavg(), "rows": rows,
              "mismatches": sum(v for r in rows for k, v in r.items() if k.endswith("_mismatches"))}
    if report["mismatches"]:
        print(f"!!! {report['mismatches']} requests differ from their single-stream output", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
