"""Mean acceptance length of tree verification against the chain, on held-out chat prompts.

    python benchmarks/tree_acceptance.py --target DIR --draft DIR --drafter dflash2 --data DATA_DIR \
        [--prompts 16] [--max-new-tokens 128] [--budgets 16,32] [--temperature 0] [--lookup] \
        [--shape NAME='{"scores": "selector", "score_temperature": 1.5}' ...]
    python benchmarks/tree_acceptance.py --pair tiny [--drafter dflash2] ...   # the shipped pair

Runs the chain (the default verifier) and the `tree` verifier at each budget and tree shape
(``--shape``: a name and `tree` verifier options beside budget; default one shape, the
verifier's defaults) on the same prompts (the held-out split of `speculant train data`; with
``--pair tiny`` the shipped pair and its held-out Python windows, benchmarks/embedded_pair.py), and
prints a JSON line per arm: mean acceptance length over the prompts, and the ratio to the chain.
``--lookup`` turns prompt lookup on for every arm (the copy rides as one more path of a tree). Acceptance does not depend on the machine's
load, so the figure holds on a busy CPU; tokens/s is printed beside it but is not a ratio to quote
unless the machine was quiet.
"""

from __future__ import annotations

import argparse
import json
import statistics

import speculant


def held_out(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[list[int]]:
    """The held-out prompts of ``--pair tiny`` (setting ``args.target`` and ``args.draft`` to the
    shipped pair's) or of ``--data`` for ``--target``, ``args.prompts`` of them."""
    if args.pair:
        from embedded_pair import held_out_prompts
        from speculant.embedded import PAIR_DIR

        args.target, args.draft = str(PAIR_DIR / "target"), str(PAIR_DIR / args.drafter)
        return held_out_prompts(args.prompts)
    if not (args.target and args.draft and args.data):
        parser.error("give --target, --draft and --data, or --pair tiny")
    from transformers import AutoTokenizer

    from speculant.training.data import held_out_prompt_ids

    return held_out_prompt_ids(args.data, AutoTokenizer.from_pretrained(args.target))[: args.prompts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=["tiny"], help="the shipped pair (no --target, --draft, --data)")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--drafter", default="dflash2")
    p.add_argument("--data")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budgets", default="16,32")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookup", action="store_true", help="prompt lookup on in every arm")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=JSON",
                   help="a tree shape: its name and `tree` verifier options (repeatable)")
    p.add_argument("--no-chain", action="store_true", help="skip the chain arm (ratios then read 1.0 for the first)")
    args = p.parse_args()
    shapes = [(name, json.loads(options)) for name, options in (s.split("=", 1) for s in args.shape)] or [("", {})]
    prompts = held_out(p, args)
    trees = [(f"tree B={b} {name}".rstrip(), {"kind": "tree", "options": {"budget": int(b), "width": args.width, **options}})
             for name, options in shapes for b in args.budgets.split(",")]
    arms = ([] if args.no_chain else [("chain", None)]) + trees
    chain = None
    for name, verifier in arms:
        config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                  "target": {"path": args.target},
                  "drafter": {"kind": args.drafter, "path": args.draft, "lookup": {"enabled": args.lookup}}}
        if verifier:
            config["verifier"] = verifier
        engine = speculant.load_engine(config)
        taus, rates = [], []
        for i, ids in enumerate(prompts):
            stats = engine.run(prompt_ids=ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               seed=args.seed + i).stats
            taus.append(stats.mean_acceptance_length)
            rates.append(stats.decode_tokens_per_s)
        tau = statistics.mean(taus)
        chain = chain or tau
        print(json.dumps({"arm": name, "temperature": args.temperature, "prompts": len(prompts), "lookup": args.lookup,
                          "mean_acceptance_length": round(tau, 3), "vs_chain": round(tau / chain, 3),
                          "median_decode_tokens_per_s": round(statistics.median(rates), 2)}), flush=True)


if __name__ == "__main__":
    main()
