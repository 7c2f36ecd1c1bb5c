"""Trees while batched against chains while batched (docs/batching.md, "Trees while batched").

Two engines over the same pair, in one process: ``chain`` (``speculative_sampling``: every cycle a
chain) and ``tree`` (the ``tree`` verifier, ``--budget`` drafted nodes, capped in a batch at the
width the chains pad the block to). For each concurrency c, c of batch_generate.py's code prompts
run batched (``run_many``, greedy), the two arms alternating and their order reversed every other
repeat. Reported: medians over ``--repeats`` of tokens/s and of tree / chain within a repeat, the
batched cycles and trees verified per run, and whether both arms' tokens are identical (they must
be: printed loudly, exit 1, if not). One warm-up of each arm before timing.

    python benchmarks/batch_trees.py [--backend torch|mlx] [--config FILE] [--concurrency 2,4]
        [--budget 16] [--max-new-tokens 96] [--repeats 3] [--threads 2] [--plan on|off]

With ``--plan off`` no batch plan narrows the rows (each drafts its whole room), so which cycles
verify trees depends on the tokens alone, not on this host's timings (the smoke test's setting).

The default pair is the shipped one with DFlash2 (a drafter whose per-position distributions the
trees are built from; the default pair SmolLM2 ships none yet).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_generate import commit, prompts_for  # noqa: E402

ARMS = {"chain": {"kind": "speculative_sampling"}, "tree": {"kind": "tree"}}


def engines_for(args: argparse.Namespace) -> dict:
    from speculant import embedded
    from speculant.api import load_engine
    from speculant.core.config import EngineConfig

    if args.config:
        base = EngineConfig.load(args.config).model_dump(mode="json")
    else:
        base = embedded.engine_config("dflash2", backend=args.backend)
    engines = {}
    for arm, verifier in ARMS.items():
        options = {"budget": args.budget} if arm == "tree" else {}
        engines[arm] = load_engine({**base, "verifier": {**verifier, "options": options}})
        engines[arm].batch_plan.enabled = args.plan == "on"
    return engines


def measure(engines: dict, c: int, args: argparse.Namespace) -> bool:
    prompts = prompts_for(c)
    for engine in engines.values():
        engine.run_many(prompts, max_new_tokens=16, temperature=0.0, max_batch=c)  # warm-up
    rates: dict[str, list[float]] = {arm: [] for arm in engines}
    ratios, outputs, counts = [], {}, {}
    for repeat in range(args.repeats):
        for arm in (list(engines) if repeat % 2 == 0 else list(engines)[::-1]):
            start = time.perf_counter()
            results = engines[arm].run_many(prompts, max_new_tokens=args.max_new_tokens, temperature=0.0, max_batch=c)
            seconds = time.perf_counter() - start
            rates[arm].append(sum(len(r.token_ids) for r in results) / seconds)
            outputs[arm] = [r.token_ids for r in results]
            counts[arm] = (sum(r.stats.batched_cycles for r in results),
                           sum(r.stats.verifier.get("trees", 0) for r in results))
        ratios.append(rates["tree"][-1] / rates["chain"][-1])
    same = outputs["tree"] == outputs["chain"]
    print(f"c={c:<3} chain {statistics.median(rates['chain']):8.1f} tok/s ({counts['chain'][0]} batched cycles)  "
          f"tree {statistics.median(rates['tree']):8.1f} tok/s ({counts['tree'][0]} batched cycles, "
          f"{counts['tree'][1]} trees)  tree/chain {statistics.median(ratios):.3f}x "
          f"(per repeat {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    if not same:
        print("!!! MISMATCH: tree and chain tokens differ", flush=True)
    return same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    parser.add_argument("--config", metavar="FILE", help="engine config file (its verifier is replaced per arm)")
    parser.add_argument("--concurrency", default="2,4")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    parser.add_argument("--plan", choices=("on", "off"), default="on",
                        help="off: no batch plan, every row drafts its whole room (no timing decides a width)")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels + [args.budget, args.max_new_tokens, args.repeats]) < 1:
        parser.error("--concurrency, --budget, --max-new-tokens and --repeats must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    engines = engines_for(args)
    print(f"{args.backend} / {args.config or 'shipped pair, DFlash2'}: commit {commit()}, threads {args.threads}, "
          f"budget {args.budget}, {args.max_new_tokens} new tokens, {args.repeats} repeats, plan {args.plan}", flush=True)
    return 0 if all([measure(engines, c, args) for c in levels]) else 1


if __name__ == "__main__":
    sys.exit(main())
