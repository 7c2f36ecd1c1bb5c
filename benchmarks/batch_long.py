"""One long request beside short ones (a server's mixed load): speculative batched against plain
batched decoding of the same target, in one process, the arms alternating each repeat.

``--concurrency`` requests start together through one scheduler (``max_batch`` = all of them):
the first ``--long-requests`` ask ``--long`` new tokens, the others ``--max-new-tokens``, all
greedy with EOS ignored, so the long ones run on after the others leave (alone, or as a smaller
batch). Reported: medians over ``--repeats`` of the whole batch's tokens/s per arm and of their
ratio (spec / plain), and what the first long request did with its drafter (drafted tokens
submitted, prompt-lookup cycles, its ``stats.batch_note``: when the batch turned drafting off and
when it came back). Every request's tokens must equal its single-stream run (checked on the first
repeat; printed loudly, exit 1).

    python benchmarks/batch_long.py [--pair smollm2 | --config FILE] [--backend torch|mlx]
        [--concurrency 16] [--long 256] [--long-requests 1] [--max-new-tokens 64] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_generate import commit, engine_config, prompts_for  # noqa: E402


def run_batch(engine, prompt_ids: list[list[int]], budgets: list[int]) -> tuple[float, list]:
    """Wall seconds of the whole batch, and each request (tokens, stats) in order."""
    from speculant.core.scheduler import Scheduler

    requests = [engine.request(ids, n, ignore_eos=True, temperature=0.0) for ids, n in zip(prompt_ids, budgets)]
    scheduler, tokens = Scheduler(engine, max_batch=len(requests), whole=True), {}
    for key, request in enumerate(requests):
        request.key = key
        scheduler.add(request)
    start = time.perf_counter()
    for request, chunk in scheduler.run():
        tokens.setdefault(request.key, []).extend(chunk.token_ids)
    seconds = time.perf_counter() - start
    return seconds, [(tokens.get(i, []), r.loop.stats) for i, r in enumerate(requests)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "mlx"))
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE")
    source.add_argument("--pair", metavar="NAME", default="smollm2")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--long", type=int, default=256, help="new tokens of the long requests")
    parser.add_argument("--long-requests", type=int, default=1, help="how many requests are long (the first ones)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens of the others")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    args = parser.parse_args(argv)
    args.mid = None
    import torch

    torch.set_num_threads(args.threads)
    from speculant.api import load_engine

    engine = load_engine(engine_config(args, Path(".")))
    engines = {"spec": engine, "plain": engine.without_drafter()}
    prompt_ids = [engine.tokenizer.encode(p) for p in prompts_for(args.concurrency)]
    longs = min(args.long_requests, args.concurrency)
    budgets = [args.long] * longs + [args.max_new_tokens] * (args.concurrency - longs)
    want = [engines["plain"].run(prompt_ids=ids, max_new_tokens=n, ignore_eos=True).token_ids
            for ids, n in zip(prompt_ids, budgets)]
    for each in engines.values():  # warm-up
        run_batch(each, prompt_ids[:2], [8, 8])
    print(f"{engine.backend.config.kind} / {args.config or args.pair}: commit {commit()}, threads {args.threads}, "
          f"{args.concurrency} requests, the first {longs} ask {args.long} new tokens, the others {args.max_new_tokens}",
          flush=True)
    rates: dict[str, list[float]] = {"spec": [], "plain": []}
    mismatches, long_stats = 0, []
    for repeat in range(args.repeats):
        order = ["spec", "plain"] if repeat % 2 == 0 else ["plain", "spec"]
        for arm in order:
            seconds, results = run_batch(engines[arm], prompt_ids, budgets)
            rates[arm].append(sum(len(t) for t, _ in results) / seconds)
            if repeat == 0:
                mismatches += sum(t != w for (t, _), w in zip(results, want))
            if arm == "spec":
                long_stats.append(results[0][1])
        print(f"  repeat {repeat + 1}: spec {rates['spec'][-1]:.1f} tok/s, plain {rates['plain'][-1]:.1f}, "
              f"first long request: {sum(long_stats[-1].submitted_per_position)} drafts submitted "
              f"({long_stats[-1].lookup_steps} copy cycles), note {long_stats[-1].batch_note!r}",
              flush=True)
    ratios = [s / p for s, p in zip(rates["spec"], rates["plain"])]
    print(f"median: spec {statistics.median(rates['spec']):.1f} tok/s, plain {statistics.median(rates['plain']):.1f}, "
          f"spec / plain {statistics.median(ratios):.3f}x (per repeat {', '.join(f'{r:.3f}' for r in ratios)})")
    if mismatches:
        print(f"!!! {mismatches} requests differ from their single-stream output", flush=True)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
