"""The prefix cache on a multi-turn conversation: time to first token per turn, cache on vs off.

    python benchmarks/prefix_cache.py [--backend torch] [--system-tokens 2000] [--turns 4]
                                      [--max-new-tokens 32] [--repeats 3] [--target DIR]

A conversation of token ids (``engine.session().extend``) on the shipped pair (or ``--target``,
plain decoding): a long system text, then short user turns; each turn sends the whole
conversation. The same turns run on an engine with the cache off and one with it on; their outputs
must be identical. Reported: the median TTFT of each turn over ``--repeats`` conversations, and
turns 2.. over turn 1 (the issue's goal: <= 1/10 on the default pair).
"""

from __future__ import annotations

import argparse
import statistics

TEXT = ("You are a careful assistant for a software team. Follow the coding rules: small functions, names "
        "that say what a thing is, tests for every change, no copy-paste. ")
TURNS = ["How do I reverse a list in Python?", "And a string?", "Now sort it backwards.", "Thanks, one more: a dict?"]


def conversation(engine, system_ids: list[int], turns: int, new: int) -> tuple[list[float], list[list[int]], list[int]]:
    """(TTFT per turn, output ids per turn, cached tokens per turn) of one conversation."""
    session = engine.session()
    times, outputs, cached = [], [], []
    for i in range(turns):
        ids = (system_ids if i == 0 else []) + engine.tokenizer.encode("\n" + TURNS[i % len(TURNS)] + "\n",
                                                                      add_special_tokens=False)
        result = session.extend(ids, max_new_tokens=new, ignore_eos=True, temperature=0)
        times.append(result.stats.ttft_s)
        outputs.append(result.token_ids)
        cached.append(result.stats.cached_tokens)
    return times, outputs, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--target", help="a target folder (plain decoding) instead of the shipped pair")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from speculant import embedded
    from speculant.api import load_engine

    config = embedded.engine_config(backend=args.backend) if args.target is None else \
        {"backend": {"kind": args.backend}, "target": {"path": args.target}}
    engines = {"off": load_engine({**config, "prefix_cache": {"max_bytes": 0}}), "on": load_engine(config)}
    tokenizer = engines["on"].tokenizer
    system_ids = tokenizer.encode(TEXT * (args.system_tokens // len(tokenizer.encode(TEXT)) + 1))[: args.system_tokens]
    ttft: dict[str, list[list[float]]] = {"off": [], "on": []}
    same, cached = True, []
    for _ in range(args.repeats):
        outputs = {}
        for arm, engine in engines.items():
            engine.prefix_store.clear()  # each conversation starts cold
            times, outputs[arm], turn_cached = conversation(engine, system_ids, args.turns, args.max_new_tokens)
            ttft[arm].append(times)
            if arm == "on":
                cached = turn_cached
        same &= outputs["on"] == outputs["off"]
    engine = engines["on"]
    print(f"{args.backend}, {engine.target.info.path}, system {len(system_ids)} tokens, {args.turns} turns, "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats; fast path: {engine.target.fast_path}")
    for arm in ("off", "on"):
        medians = [statistics.median(run[i] for run in ttft[arm]) for i in range(args.turns)]
        later = [m / medians[0] for m in medians[1:]]
        print(f"cache {arm:3}: TTFT ms per turn " + ", ".join(f"{m * 1000:.1f}" for m in medians)
              + f"; turns 2..{args.turns} over turn 1: " + ", ".join(f"{r:.3f}" for r in later))
    print(f"cached prompt tokens per turn (cache on): {cached}")
    print(f"identical outputs, cache on vs off: {same}")


if __name__ == "__main__":
    main()
