"""What requests joining a batch cost (issue #39; docs/batching.md, "Joining").

Two measurements on one target (plain decoding, greedy), in one process:

- ``joins``: ``--requests`` prompts (batch_generate.py's code prompts) join a new batch in one
  ``BatchedTarget.join_many`` call (short prompts prefill as rows of one padded forward) against
  one ``join`` each; seconds, medians over ``--repeats``, the two arms alternating. Each request's
  first token must be the same either way (printed loudly if not).
- ``long``: four requests decode in a scheduler while a ``--long-tokens`` prompt joins (a new
  prompt each repeat, so the prefix cache restores nothing); the longest and the median wait
  between two chunks of the first request, with the long prompt joining a chunk of the batch's
  ``join_tokens`` between cycles (``chunked``) against the whole prompt at once (``whole``).

    python benchmarks/batch_joins.py [--backend torch|mlx] [--pair smollm2 | --config FILE]
        [--requests 16] [--long-tokens 2000] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch_generate import commit, engine_config, prompts_for  # noqa: E402


def time_joins(engine, prompts: list[list[int]], together: bool) -> tuple[float, list[int]]:
    """Seconds for ``prompts`` to join a new batch, and each one's first (greedy) token."""
    batch = engine.target.new_batch()
    start = time.perf_counter()
    if together:
        outs = batch.join_many([(i, p, None) for i, p in enumerate(prompts)])
    else:
        outs = [batch.join(i, p) for i, p in enumerate(prompts)]
    firsts = [int(engine.backend.ops.to_numpy(out.logits[-1]).argmax()) for out in outs]
    return time.perf_counter() - start, firsts


def chunk_gaps(engine, short: list[list[int]], long: list[int], chunked: bool) -> list[float]:
    """Seconds between the first request's chunks while ``long`` joins the four decoding."""
    from speculant.core.loop import Loop
    from speculant.core.scheduler import Request, Scheduler

    batch_type = type(engine.target.new_batch())
    kept = batch_type.join_tokens
    batch_type.join_tokens = kept if chunked else 10 ** 9  # past its length: one prefill
    try:
        sampling, generation, block = engine._settings(48, {"ignore_eos": True})
        requests = [Request(Loop(engine, p, sampling, generation, block), (), key=i)
                    for i, p in enumerate(short + [long])]
        scheduler, times = Scheduler(engine, max_batch=len(requests)), []
        for request in requests[:-1]:
            scheduler.add(request)
        for request, _ in scheduler.run():
            if request.key == 0:
                times.append(time.perf_counter())
                if len(times) == 4:  # decoding together: now the long prompt arrives
                    scheduler.add(requests[-1])
    finally:
        batch_type.join_tokens = kept
    return [b - a for a, b in zip(times, times[1:])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="engine config file")
    source.add_argument("--pair", default="smollm2", help="a named pair (default: smollm2, the default pair)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    args = parser.parse_args(argv)
    args.mid = None
    if min(args.requests, args.long_tokens, args.repeats) < 1:
        parser.error("--requests, --long-tokens and --repeats must be at least 1")
    import torch

    torch.set_num_threads(args.threads)
    from speculant.api import load_engine

    with tempfile.TemporaryDirectory() as tmp:
        engine = load_engine(engine_config(args, Path(tmp))).without_drafter()
    encode = engine.tokenizer.encode
    prompts = [encode(p) for p in prompts_for(args.requests)]
    text = encode("\n".join(prompts_for(400)))
    print(f"{args.backend} / {args.config or args.pair}: commit {commit()}, threads {args.threads}, "
          f"{args.repeats} repeats", flush=True)

    seconds, firsts = {True: [], False: []}, {}
    time_joins(engine, prompts[:2], True)  # warm-up
    for repeat in range(args.repeats):
        for together in ((False, True) if repeat % 2 == 0 else (True, False)):
            s, firsts[together] = time_joins(engine, prompts, together)
            seconds[together].append(s)
    alone, together = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"joins  {args.requests} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens: "
          f"one each {alone:.3f} s, together {together:.3f} s, {alone / together:.2f}x", flush=True)
    if firsts[True] != firsts[False]:
        print("!!! MISMATCH: first tokens differ between joining together and alone", flush=True)

    gaps = {True: [], False: []}
    short = prompts[:4]
    for repeat in range(args.repeats):
        for chunked in (False, True):
            at = (2 * repeat + chunked + 1) * 17  # a new long prompt each run: the prefix cache restores none
            gaps[chunked].append(chunk_gaps(engine, short, text[at:at + args.long_tokens], chunked))
    for chunked in (False, True):
        longest = statistics.median(max(g) for g in gaps[chunked])
        typical = statistics.median(statistics.median(g) for g in gaps[chunked])
        print(f"long   {args.long_tokens}-token prompt joining 4 decoding, {'chunked' if chunked else 'whole  '}: "
              f"longest wait {longest:.3f} s, median wait {typical:.3f} s", flush=True)
    return 1 if firsts[True] != firsts[False] else 0


if __name__ == "__main__":
    sys.exit(main())
