"""What requests joining a batch cost (issue #39; docs/batching.md, "Joining").

Four measurements on one target (plain decoding, greedy), in one process:

- ``joins``: ``--requests`` prompts (batch_generate.py's code prompts) join a new batch in one
  ``BatchedTarget.join_many`` call (short prompts prefill as rows of one padded forward) against
  one ``join`` each; seconds, medians over ``--repeats``, the two arms alternating. Each request's
  first token must be the same either way (printed loudly if not).
- ``shared``: the same, each prompt behind a ``--shared-tokens`` system prompt that a snapshot
  of the target restores (as the prefix cache does): the rows restoring it prefill their own
  tokens together (``join_many``) against one ``join`` each.
- ``long``: four requests decode in a scheduler while a ``--long-tokens`` prompt joins (a new
  prompt each repeat, so the prefix cache restores nothing); the longest and the median wait
  between two chunks of the first request, with the long prompt joining a chunk of the batch's
  ``join_tokens`` between cycles (``chunked``) against the whole prompt at once (``whole``).
- ``move``: a request with a ``--long-tokens`` prompt decodes alone (on the target's own cache)
  until a short one arrives, then both decode batched; the wait between its two chunks around
  that moment, with its caches copied into a batch row (``copied``) against rebuilt there by a
  prefill of its context (``rebuilt``, the way before ``BatchedTarget.join_snapshot``). Both of
  its outputs must be the same (printed loudly if not).

    python benchmarks/batch_joins.py [--backend torch|mlx] [--pair smollm2 | --config FILE]
        [--requests 16] [--long-tokens 2000] [--shared-tokens 300] [--repeats 3] [--threads 2]
        [--measure joins,shared,long,move]
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


def time_joins(engine, prompts: list[list[int]], together: bool, restored=None) -> tuple[float, list[int]]:
    """Seconds for ``prompts`` to join a new batch (each after ``restored``, a stored prefix, where
    given), and each one's first (greedy) token."""
    batch = engine.target.new_batch()
    start = time.perf_counter()
    if together:
        outs = batch.join_many([(i, p, restored) for i, p in enumerate(prompts)])
    else:
        outs = [batch.join(i, p, restored=restored) for i, p in enumerate(prompts)]
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


def move_wait(engine, long: list[int], short: list[int], copied: bool) -> tuple[float, list[int]]:
    """Seconds between the long request's chunks as the short one arrives (it moves into a batch),
    and its tokens."""
    from speculant.core.loop import Loop
    from speculant.core.scheduler import Request, Scheduler

    batch_type = type(engine.target.new_batch())
    kept = batch_type.join_snapshot
    if not copied:
        batch_type.join_snapshot = lambda self, key, snapshot: False  # the batch takes no copy: a prefill
    try:
        sampling, generation, block = engine._settings(24, {"ignore_eos": True})
        first, second = (Request(Loop(engine, p, sampling, generation, block), (), key=i)
                         for i, p in enumerate((long, short)))
        scheduler, times, tokens = Scheduler(engine, max_batch=2), [], []
        scheduler.add(first)
        for request, chunk in scheduler.run():
            if request.key == 0:
                times.append(time.perf_counter())
                tokens += chunk.token_ids
                if len(times) == 4:  # decoding alone: now the short one arrives
                    scheduler.add(second)
    finally:
        batch_type.join_snapshot = kept
    return times[4] - times[3], tokens


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
    parser.add_argument("--shared-tokens", type=int, default=300)
    parser.add_argument("--measure", default="joins,shared,long,move", help="which measurements, comma-separated")
    args = parser.parse_args(argv)
    measures = set(args.measure.split(","))
    if not measures or measures - {"joins", "shared", "long", "move"}:
        parser.error("--measure takes joins, shared, long and move, comma-separated")
    args.mid = None
    if min(args.requests, args.long_tokens, args.shared_tokens, args.repeats) < 1:
        parser.error("--requests, --long-tokens, --shared-tokens and --repeats must be at least 1")
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

    runs = {"joins": measure_joins, "shared": measure_shared, "long": measure_long, "move": measure_move}
    same = [run(engine, prompts, text, args) for name, run in runs.items() if name in measures]
    return 0 if all(same) else 1


def measure_joins(engine, prompts: list[list[int]], text: list[int], args) -> bool:
    what = f"joins  {args.requests} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens"
    return compare_joins(engine, prompts, None, what, args.repeats)


def measure_shared(engine, prompts: list[list[int]], text: list[int], args) -> bool:
    """``joins`` for prompts behind a ``--shared-tokens`` system prompt that a snapshot restores."""
    system = text[:args.shared_tokens]
    engine.target.reset()
    engine.target.prefill(system)
    stored = (engine.target.snapshot(), len(system))
    what = f"shared {args.requests} prompts behind a restored {len(system)}-token prefix"
    return compare_joins(engine, [system + p for p in prompts], stored, what, args.repeats)


def compare_joins(engine, prompts: list[list[int]], restored, what: str, repeats: int) -> bool:
    """``prompts`` joining one each against together, alternating; False if the first tokens differ."""
    seconds, firsts = {True: [], False: []}, {}
    time_joins(engine, prompts[:2], True, restored)  # warm-up
    for repeat in range(repeats):
        for together in ((False, True) if repeat % 2 == 0 else (True, False)):
            s, firsts[together] = time_joins(engine, prompts, together, restored)
            seconds[together].append(s)
    alone, together = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"{what}: one each {alone:.3f} s, together {together:.3f} s, {alone / together:.2f}x", flush=True)
    if firsts[True] != firsts[False]:
        print("!!! MISMATCH: first tokens differ between joining together and alone", flush=True)
    return firsts[True] == firsts[False]


def measure_long(engine, prompts: list[list[int]], text: list[int], args) -> bool:
    gaps = {True: [], False: []}
    for repeat in range(args.repeats):
        for chunked in (False, True):
            at = (2 * repeat + chunked + 1) * 17  # a new long prompt each run: the prefix cache restores none
            gaps[chunked].append(chunk_gaps(engine, prompts[:4], text[at:at + args.long_tokens], chunked))
    for chunked in (False, True):
        longest = statistics.median(max(g) for g in gaps[chunked])
        typical = statistics.median(statistics.median(g) for g in gaps[chunked])
        print(f"long   {args.long_tokens}-token prompt joining 4 decoding, {'chunked' if chunked else 'whole  '}: "
              f"longest wait {longest:.3f} s, median wait {typical:.3f} s", flush=True)
    return True


def measure_move(engine, prompts: list[list[int]], text: list[int], args) -> bool:
    waits, outputs = {True: [], False: []}, {}
    for repeat in range(args.repeats):
        for copied in (False, True):
            at = (repeat + 1) * 23  # the same prompt both ways (its prefill alone may be restored: not timed)
            wait, outputs[copied, repeat] = move_wait(engine, text[at:at + args.long_tokens], prompts[0], copied)
            waits[copied].append(wait)
    for copied in (False, True):
        print(f"move   a request with a {args.long_tokens}-token prompt moving into a batch, "
              f"{'copied' if copied else 'rebuilt'}: wait {statistics.median(waits[copied]):.3f} s", flush=True)
    same = all(outputs[True, r] == outputs[False, r] for r in range(args.repeats))
    if not same:
        print("!!! MISMATCH: the moving request's tokens differ between copied and rebuilt caches", flush=True)
    return same

if __name__ == "__main__":
    sys.exit(main())
