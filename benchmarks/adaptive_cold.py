"""The shipped pair with a fresh engine per request (the adaptive policy starts cold each time):
plain decoding, a fixed width, and ``adaptive`` with and without its repeat hint, side by side.

    python benchmarks/adaptive_cold.py [--prompts 8] [--repeats 2] [--max-new-tokens 128] [--threads 2]

Every repeat runs every variant on every held-out prompt back to back; the speed-ups are per-run
ratios to the plain run of the same prompt and repeat, summarised by median and mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = {"plain": None, "fixed width": {"kind": "auto"}, "adaptive": {"kind": "adaptive"},
            "adaptive, no repeat hint": {"kind": "adaptive", "options": {"probe_on_repeat": False}}}


def main() -> None:
    import torch

    import speculant
    from embedded_pair import held_out_prompts
    from speculant import embedded

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = held_out_prompts(args.prompts)
    speculant.load_engine(embedded.engine_config("dflash2", lookup=False)).run(prompt_ids=prompts[0], max_new_tokens=16)  # process warm-up
    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for prompt in prompts:
            for name, verifier in VARIANTS.items():
                config = embedded.engine_config(None if verifier is None else "dflash2", lookup=False)
                if verifier is not None:
                    config["verifier"] = verifier
                engine = speculant.load_engine(config)
                stats = engine.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True).stats
                rates[name].append(stats.decode_tokens_per_s)
    for name, values in rates.items():
        ratios = [a / b for a, b in zip(values, rates["plain"])]
        print(f"{name:26} median {statistics.median(values):6.1f} tok/s  speed-up median {statistics.median(ratios):.2f}x"
              f"  mean {statistics.mean(ratios):.2f}x")


if __name__ == "__main__":
    main()
