"""Muse Glimmer with its own DFlash assistant: speculant against transformers' native DFlash
(``generate(assistant_model=..., speculation_type="dflash")``), both against plain greedy.

    python benchmarks/muse_glimmer_native.py [--repeats 5] [--new-tokens 128] [--threads 2]

One process, one random Muse Glimmer target (hidden 256, 8 layers, a planted bias so that
drafts are partly accepted) and a random assistant built for it (3 layers, window 32). Each
repeat runs the four ways in turn on every prompt (interleaved, so drift hits all alike);
tokens/s are medians over repeats of the prompts' total new tokens over their total time;
ratios are printed both as ratios of medians and as medians of per-repeat ratios.
Every run's tokens are checked against transformers' plain greedy and the check is printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS = ([5, 6, 7, 8, 9], list(range(20, 120)))  # shorter and longer than both windows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--planted", type=float, default=1.1)
    args = parser.parse_args()
    import torch
    from transformers import MuseGlimmerAssistantModel, MuseGlimmerForConditionalGeneration

    import speculant
    from speculant.testing.tiny_muse_glimmer import (build_tiny_muse_glimmer_assistant,
                                                     build_tiny_muse_glimmer_target)

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    target = build_tiny_muse_glimmer_target(root / "target", hidden_size=256, num_layers=8, sliding_window=64,
                                            planted=args.planted)
    assistant = build_tiny_muse_glimmer_assistant(root / "assistant", target, target_layer_ids=[1, 3, 5],
                                                  sliding_window=32)
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
              "verifier": {"kind": "greedy"}}
    spec = speculant.load_engine({**config, "drafter": {"kind": "dflash", "path": str(assistant),
                                                              "lookup": False}})
    spec_plain = speculant.load_engine(config)
    hf_target = MuseGlimmerForConditionalGeneration.from_pretrained(str(target), dtype=torch.float32).eval()
    hf_assistant = MuseGlimmerAssistantModel.from_pretrained(str(assistant), dtype=torch.float32).eval()
    n = args.new_tokens

    def hf(prompt, **kw):
        with torch.no_grad():
            out = hf_target.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, **kw)
        return out[0, len(prompt):].tolist()

    ways = {
        "speculant dflash": lambda p: spec.run(prompt_ids=p, max_new_tokens=n, ignore_eos=True).token_ids,
        "speculant plain": lambda p: spec_plain.run(prompt_ids=p, max_new_tokens=n, ignore_eos=True).token_ids,
        "transformers dflash": lambda p: hf(p, assistant_model=hf_assistant, speculation_type="dflash"),
        "transformers plain": lambda p: hf(p),
    }
    reference = {i: hf(p) for i, p in enumerate(PROMPTS)}
    assert all(len(r) == n for r in reference.values()), "eos inside the run: pick other prompts"
    for way in ways.values():  # warm-up
        way(PROMPTS[0])
    rates: dict[str, list[float]] = {name: [] for name in ways}
    identical = {name: True for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            start = time.perf_counter()
            outputs = [way(p) for p in PROMPTS]
            rates[name].append(n * len(PROMPTS) / (time.perf_counter() - start))
            identical[name] &= all(out == reference[i] for i, out in enumerate(outputs))
        print("repeat:", ", ".join(f"{name} {r[-1]:.1f}" for name, r in rates.items()), "tok/s", flush=True)
    acceptance = [spec.run(prompt_ids=p, max_new_tokens=n, ignore_eos=True).stats.mean_acceptance_length
                  for p in PROMPTS]
    tps = {name: statistics.median(r) for name, r in rates.items()}
    print(f"prompts of {[len(p) for p in PROMPTS]} tokens, {n} new tokens each, {args.repeats} repeats, "
          f"{args.threads} threads; speculant mean acceptance per prompt {[round(a, 2) for a in acceptance]}")
    for name in ways:
        print(f"{name:>20}: {tps[name]:7.1f} tok/s (median)   output identical to plain greedy: {identical[name]}")
    # ratios of medians, and the median of each repeat's ratio (the two runs it compares sat
    # next to each other in time, so load changes on a shared machine cancel better)
    for a, b in (("speculant dflash", "transformers dflash"), ("speculant dflash", "transformers plain"),
                 ("transformers dflash", "transformers plain"), ("speculant dflash", "speculant plain")):
        paired = statistics.median(x / y for x, y in zip(rates[a], rates[b]))
        print(f"{a} / {b}: {tps[a] / tps[b]:.2f}x (median of per-repeat ratios {paired:.2f}x)")


if __name__ == "__main__":
    main()
