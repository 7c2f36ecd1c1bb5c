"""The shipped model pair on held-out Python files: mean acceptance length of DFlash, DFlash2
and MTP (K = 2), and each drafter's decode speed-up over plain decoding of the same target,
measured side by side (greedy, block 8 unless --block-size says otherwise).

    python benchmarks/embedded_pair.py [--backend torch|mlx] [--dtype bfloat16[,float32]] [--prompts 8]
                                       [--max-new-tokens 128] [--threads 2] [--verifiers auto,adaptive]
                                       [--block-size 8] [--prompt-len 64]

Prompts are 64-token windows of the held-out standard-library files (never trained on). For
each prompt every engine runs back to back (plain first), so machine drift hits them alike;
the speed-up is the per-prompt ratio of decode tok/s to plain decoding's, and medians are
reported. Decode tok/s counts the tokens after the first one over the time after it.
"same tokens" counts prompts whose output equals plain decoding's token for token: in float32
that is every prompt (lossless); in bfloat16 a block forward and a one-token forward round
differently, so near-ties can flip.
"""

from __future__ import annotations

import argparse
import json
import statistics


def engines(backend: str, dtype: str, verifiers: list[str], block_size: int = 8,
            lookups: tuple[bool, ...] = (False,)) -> dict[str, object]:
    import speculant
    from speculant import embedded

    def make(drafter: str | None, verifier: str = "auto", block: int | None = None, lookup: bool = False):
        config = embedded.engine_config(drafter, backend=backend, lookup=lookup)  # the shipped lookup settings
        if drafter is None and lookup:
            config["drafter"] = {"lookup": {"enabled": True, **embedded.LOOKUP}}
        config["backend"]["dtype"] = dtype
        config["verifier"] = {"kind": verifier}
        if block:
            config["drafter"]["block_size"] = block
        return speculant.load_engine(config)

    out = {"plain": make(None)}
    if True in lookups:  # prompt-lookup decoding alone: copies where something matches, plain steps elsewhere
        out["lookup only"] = make(None, block=block_size, lookup=True)
    for verifier in verifiers:
        for lookup in lookups:
            suffix = ("" if verifier == "auto" else f"+{verifier}") + ("+lookup" if lookup else "")
            # the block is set, not left to the drafter's default (DFlash2's is 5 on MLX)
            out[f"dflash{suffix}"] = make("dflash", verifier, block_size, lookup)
            out[f"dflash2{suffix}"] = make("dflash2", verifier, block_size, lookup)
            out[f"mtp(K=2){suffix}"] = make("mtp", verifier, 3, lookup)
    return out


def held_out_prompts(count: int, length: int = 64) -> list[list[int]]:
    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    return [p.tolist() for p in corpus_prompts(PAIR_DIR / "target", count, length, seed=1234, held_out=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", default="bfloat16", help="comma-separated: several dtypes run side by side")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64,
                        help="prompt tokens (the drafters were trained on contexts of at most 320)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads")
    parser.add_argument("--block-size", type=int, default=8, help="runtime block of DFlash and DFlash2 (the trained one is 8)")
    parser.add_argument("--verifiers", default="auto", help="comma-separated verifier kinds to run the drafters with")
    parser.add_argument("--lookup", action="store_true",
                        help="also run every drafter with prompt lookup (the shipped pair's settings), side by side")
    parser.add_argument("--json", help="also write the per-prompt results here")
    args = parser.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    dtypes = args.dtype.split(",")
    lookups = (False, True) if args.lookup else (False,)
    runs = {dtype: engines(args.backend, dtype, args.verifiers.split(","), args.block_size, lookups) for dtype in dtypes}
    prompts = held_out_prompts(args.prompts, args.prompt_len)
    for group in runs.values():  # warm-up: first-call costs stay out of the timings
        for engine in group.values():
            engine.run(prompt_ids=prompts[0], max_new_tokens=16, ignore_eos=True)
    rows = {dtype: {name: [] for name in group} for dtype, group in runs.items()}
    for prompt in prompts:
        for dtype, group in runs.items():
            for name, engine in group.items():
                stats = engine.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True).stats
                rows[dtype][name].append({"decode_tokens_per_s": stats.decode_tokens_per_s,
                                          "mean_acceptance_length": stats.mean_acceptance_length,
                                          "lookup_share": stats.lookup_steps / max(1, stats.verify_steps),
                                          "tokens": list(engine.last_token_ids)})
    for dtype in dtypes:
        report(rows[dtype], args, dtype)
    if len(dtypes) > 1:
        across(rows, dtypes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f)


def across(rows: dict[str, dict[str, list[dict]]], dtypes: list[str]) -> None:
    """Every engine's decode speed over plain decoding in the first dtype (the same prompts)."""
    base = rows[dtypes[0]]["plain"]
    print(f"speed-up over plain {dtypes[0]} decoding (median of per-prompt ratios):")
    for dtype in dtypes:
        cells = [f"{name} {statistics.median(r['decode_tokens_per_s'] / b['decode_tokens_per_s'] for r, b in zip(runs, base)):.2f}x"
                 for name, runs in rows[dtype].items()]
        print(f"  {dtype:<10}" + ", ".join(cells))


def report(rows: dict[str, list[dict]], args, dtype: str) -> None:
    plain = rows["plain"]
    print(f"shipped pair, {args.backend} {dtype}, block {args.block_size}, {len(plain)} held-out prompts "
          f"of {args.prompt_len} tokens, "
          f"{args.max_new_tokens} new tokens, greedy")
    print(f"plain decoding: median {statistics.median(r['decode_tokens_per_s'] for r in plain):.1f} tok/s")
    print(f"{'drafter':<28}{'tau mean':>9}{'tau med':>9}{'tok/s':>9}{'speed-up med':>14}{'same tokens':>13}{'copies':>8}")
    taus = {}
    for name, runs in rows.items():
        if name == "plain":
            continue
        tau = [r["mean_acceptance_length"] for r in runs]
        taus[name] = statistics.mean(tau)
        ratios = [r["decode_tokens_per_s"] / p["decode_tokens_per_s"] for r, p in zip(runs, plain)]
        same = sum(r["tokens"] == p["tokens"] for r, p in zip(runs, plain))
        copies = statistics.mean(r["lookup_share"] for r in runs)
        print(f"{name:<28}{taus[name]:>9.2f}{statistics.median(tau):>9.2f}"
              f"{statistics.median(r['decode_tokens_per_s'] for r in runs):>9.1f}"
              f"{statistics.median(ratios):>13.2f}x{same:>10}/{len(runs)}{copies:>7.0%}")
    if "dflash" in taus and "dflash2" in taus:
        print(f"DFlash2 / DFlash mean acceptance length: {taus['dflash2'] / taus['dflash']:.3f}")


if __name__ == "__main__":
    main()
