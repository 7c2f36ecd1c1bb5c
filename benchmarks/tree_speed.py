"""Tokens/s of tree verification against fixed chains, side by side (issue #40's speed goals).

    python benchmarks/tree_speed.py [--backend torch|mlx] [--target DIR --draft DIR --data DATA_DIR]
        [--prompts 8] [--max-new-tokens 64] [--repeats 3] [--temperature 0] [--lookup on|off]
        [--arms chain,plain,adaptive,adaptive_tree,tree8,tree16] [--threads 1]
        [--device cpu|cuda|mps] [--dtype float32|bfloat16] [--compile off|on|auto]

Arms (one engine each, loaded once, every arm on the same prompts):

- ``plain``: the target alone (no drafter);
- ``chain``: the default chain verifier at the drafter's block size (``chainN``: the drafter's
  ``block_size`` set to N);
- ``adaptive``: the adaptive verifier with trees off (its default);
- ``adaptive_tree``: the adaptive verifier choosing between its chain and trees
  (``tree = "auto"``); ``adaptive_tree4+8``: with ``tree_budgets = [4, 8]``;
- ``treeB``: the ``tree`` verifier with budget B, always a tree; ``measuredB``: the ``tree``
  verifier with ``choose = "measured"``.

Without ``--target`` the shipped pair runs on code prompts (benchmarks/batch_generate.py's); with
it, the real pair (docs/real-pair.md) on the held-out chat prompts of ``--data``. Every repeat
runs each prompt through every arm in turn, the arms' order reversed every other repeat, so drift
on a shared machine hits them alike. Reported per arm: the median over repeats of decode tokens/s
(all new tokens over all decode seconds of the repeat) and of its ratio to ``chain`` within the
repeat, and the mean acceptance length. Greedy outputs are checked to be equal across arms.
"""

from __future__ import annotations

import argparse
import json
import statistics


def verifier_for(arm: str) -> dict:
    if arm.startswith("chain") or arm == "plain":
        return {"kind": "auto"}
    if arm == "adaptive":
        return {"kind": "adaptive"}
    if arm.startswith("adaptive_tree"):
        budgets = {"tree_budgets": [int(b) for b in arm[13:].split("+")]} if arm[13:] else {}
        return {"kind": "adaptive", "options": {"tree": "auto", **budgets}}
    for prefix, options in (("tree", {}), ("measured", {"choose": "measured"})):
        if arm.startswith(prefix):
            return {"kind": "tree", "options": {"budget": int(arm[len(prefix):]), **options}}
    raise SystemExit(f"unknown arm {arm!r}")


def base_config(args: argparse.Namespace) -> dict:
    from speculant import embedded

    if not args.target:
        config = embedded.engine_config(backend=args.backend)
    else:
        config = {"target": {"path": args.target}, "drafter": {"kind": args.drafter, "path": args.draft}}
    backend = {"kind": args.backend, "dtype": args.dtype}
    backend.update({key: value for key, value in (("device", args.device), ("compile", args.compile)) if value})
    config.setdefault("backend", {}).update(backend)
    config["drafter"]["lookup"] = {"enabled": args.lookup == "on"}
    return config


def prompts_for(args: argparse.Namespace) -> list[dict]:
    if not args.target:
        from batch_generate import prompts_for as code_prompts

        return [{"prompt": p} for p in code_prompts(args.prompts)]
    from transformers import AutoTokenizer

    from speculant.training.data import held_out_prompt_ids

    ids = held_out_prompt_ids(args.data, AutoTokenizer.from_pretrained(args.target))[: args.prompts]
    return [{"prompt_ids": p} for p in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--drafter", default="dflash2")
    p.add_argument("--data")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--lookup", default="on", choices=["on", "off"])
    p.add_argument("--arms", default="chain,adaptive,adaptive_tree,tree8,tree16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", help="backend.device (default: the backend's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", choices=["off", "on", "auto"], help="backend.compile (default: the backend's)")
    args = p.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    import speculant

    arms = args.arms.split(",")
    base = base_config(args)
    engines = {}
    for arm in arms:
        config = {**base, "verifier": verifier_for(arm)}
        if arm.startswith("chain") and arm[5:]:
            config["drafter"] = {**config["drafter"], "block_size": int(arm[5:])}
        if arm == "plain":
            config = {key: value for key, value in config.items() if key != "drafter"}
        engines[arm] = speculant.load_engine(config)
    prompts = prompts_for(args)
    kwargs = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    for engine in engines.values():  # warm-up: compiled graphs, allocator, the adaptive models' first costs
        engine.run(**prompts[0], **kwargs, seed=0)
    rates: dict[str, list[float]] = {a: [] for a in arms}
    ratios: dict[str, list[float]] = {a: [] for a in arms}
    taus: dict[str, list[float]] = {a: [] for a in arms}
    mismatches = 0
    for repeat in range(args.repeats):
        tokens, seconds = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
        for i, prompt in enumerate(prompts):
            outputs = {}
            for arm in arms if repeat % 2 == 0 else arms[::-1]:
                result = engines[arm].run(**prompt, **kwargs, seed=i)
                outputs[arm] = result.token_ids
                tokens[arm] += result.stats.new_tokens - 1
                seconds[arm] += result.stats.decode_s
                taus[arm].append(result.stats.mean_acceptance_length)
            if args.temperature == 0:
                mismatches += sum(out != outputs[arms[0]] for out in outputs.values())
        for arm in arms:
            rates[arm].append(tokens[arm] / seconds[arm])
            ratios[arm].append(rates[arm][-1] / rates[arms[0]][-1])
    for arm in arms:
        print(json.dumps({"arm": arm, "median_decode_tokens_per_s": round(statistics.median(rates[arm]), 1),
                          f"vs_{arms[0]}": round(statistics.median(ratios[arm]), 3),
                          "mean_acceptance_length": round(statistics.mean(taus[arm]), 3),
                          "verifier": verifier_for(arm)}), flush=True)
    print(json.dumps({"backend": args.backend, "pair": "real" if args.target else "shipped", "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "temperature": args.temperature,
                      "lookup": args.lookup, "dtype": args.dtype, "compile": args.compile,
                      "fast_path": {arm: engine.target.fast_path for arm, engine in engines.items()},
                      "greedy_mismatches": mismatches}))
    if mismatches:
        raise SystemExit(f"{mismatches} greedy outputs differ between arms")


if __name__ == "__main__":
    main()
