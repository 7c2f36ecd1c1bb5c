"""Adaptive verify width vs fixed widths vs plain decoding on a workload mix (planted tiny pair).

    python benchmarks/adaptive_workloads.py [--rounds 5] [--max-new-tokens 128] [--planted 6.0]

Workloads (greedy): ``predictable`` (the planted token repeated: the draft's first token is
almost always right), ``ordinary`` (counting prompts: partial acceptance), ``random`` (random
token prompts: drafts essentially never accepted), and with ``--deep-planted`` a ``deep``
workload on a second, more strongly planted pair where whole blocks are accepted.

With ``--embedded`` the shipped pair (trained target + ``--drafter``, block 8) runs instead:
``predictable`` = boilerplate code (a class with ``__init__``/``__repr__``), ``ordinary`` =
English prose (not what a code model was trained on), ``random`` = random token ids, and
``code`` = a 64-token window of a held-out standard-library file.

Every round runs each (workload, configuration) once in a shuffled order, so drift on a shared
machine hits all alike; one adaptive verifier serves all workloads in turn, as a server would.
The primary measure is generated tokens per CPU-second of this process (``time.process_time``
around each whole generation, single-threaded torch): on a shared machine wall time swings by
2-3x with other users' load while CPU time stays within about 15 %. Wall-clock decode tokens/s
(prefill excluded) is reported too. Ratios are medians over rounds of per-round ratios
(adaptive / best fixed width, adaptive / default fixed width = the trained block, adaptive /
plain); the adaptive verifier itself still decides from wall-clock timings.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

WORKLOADS = {
    "predictable": lambda: [160] * 16,
    "ordinary": lambda: list(range(20, 52)),
    "random": lambda: [int(x) for x in random.Random(3).choices(range(150, 300), k=24)],
}


def build(root: Path, planted: float, hidden: int, layers: int, block: int) -> tuple[Path, Path]:
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    target = build_tiny_target(root / "target", seed=0, planted=planted, hidden_size=hidden, num_layers=layers,
                               max_position_embeddings=4096)
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=block)
    return target, draft


BOILERPLATE = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n"
PROSE = ("The committee met on a grey Tuesday morning to discuss the harbour, the new ferry timetable, "
         "and whether the library should stay open later during the winter months, when")


def embedded_workloads() -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(PAIR_DIR / "target"))
    code = corpus_prompts(PAIR_DIR / "target", 1, 64, seed=1234, held_out=True)[0].tolist()
    rand = [int(x) for x in random.Random(3).choices(range(300, len(tokenizer) - 2), k=24)]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return {"predictable": encode(BOILERPLATE), "ordinary": encode(PROSE), "random": rand, "code": code}


def engines(target: Path, draft: Path, device: str, dtype: str, options: dict, kind: str = "dflash") -> dict:
    import speculant

    base = {"backend": {"kind": "torch", "device": device, "dtype": dtype}, "target": {"path": str(target)}}
    drafter = {"kind": kind, "path": str(draft)}
    return {
        "plain": speculant.load_engine(base),
        "fixed": speculant.load_engine({**base, "drafter": drafter, "verifier": {"kind": "speculative_sampling"}}),
        "adaptive": speculant.load_engine({**base, "drafter": drafter, "verifier": {"kind": "adaptive", "options": options}}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--planted", type=float, default=6.0)
    parser.add_argument("--deep-planted", type=float, default=None, help="add a 'deep' workload on a pair planted this strongly")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--block", type=int, default=16, help="trained block size = default fixed width")
    parser.add_argument("--widths", default="2,4,8,12,15,16", help="fixed block sizes to compare")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adaptive-options", type=json.loads, default={}, help="verifier.options of the adaptive verifier, as JSON")
    parser.add_argument("--json", type=Path, default=None, help="also write raw results here")
    parser.add_argument("--embedded", action="store_true", help="use the shipped pair (block 8) and text workloads")
    parser.add_argument("--drafter", default="dflash2", help="with --embedded: the shipped drafter to use")
    args = parser.parse_args()
    if args.embedded:
        args.block = 8
        if args.widths == parser.get_default("widths"):
            args.widths = "2,3,4,6,8"

    import torch

    torch.set_num_threads(args.threads)
    fixed = [int(w) for w in args.widths.split(",")]
    configs = ["plain"] + [f"fixed{b}" for b in fixed] + ["adaptive"]
    with tempfile.TemporaryDirectory() as tmp:
        if args.embedded:
            from speculant.embedded import PAIR_DIR

            pairs = {"main": (PAIR_DIR / "target", PAIR_DIR / args.drafter)}
            workloads = {name: ("main", prompt) for name, prompt in embedded_workloads().items()}
        else:
            pairs = {"main": build(Path(tmp) / "main", args.planted, args.hidden, args.layers, args.block)}
            workloads = {name: ("main", make()) for name, make in WORKLOADS.items()}
        if args.deep_planted is not None and not args.embedded:
            pairs["deep"] = build(Path(tmp) / "deep", args.deep_planted, args.hidden, args.layers, args.block)
            workloads["deep"] = ("deep", [5, 6, 7])
        kind = args.drafter if args.embedded else "dflash"
        loaded = {name: engines(*paths, args.device, args.dtype, args.adaptive_options, kind) for name, paths in pairs.items()}

        def run(workload: str, config: str):
            pair, prompt = workloads[workload]
            group = loaded[pair]
            kind = "plain" if config == "plain" else "adaptive" if config == "adaptive" else "fixed"
            block = args.block if config in ("plain", "adaptive") else int(config[5:])
            kw = {} if config == "plain" else {"block_size": block}
            start = time.process_time()
            result = group[kind].run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True, **kw)
            return result, time.process_time() - start

        for workload in workloads:  # warm-up (allocations, first-call overheads)
            for config in configs:
                run(workload, config)
        cpu = {(w, c): [] for w in workloads for c in configs}
        tps = {(w, c): [] for w in workloads for c in configs}
        tau = {(w, c): [] for w in workloads for c in configs}
        widths = {w: Counter() for w in workloads}
        order = [(w, c) for w in workloads for c in configs]
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for workload, config in order:
                result, seconds = run(workload, config)
                stats = result.stats
                cpu[workload, config].append(stats.new_tokens / seconds)
                tps[workload, config].append(stats.decode_tokens_per_s)
                tau[workload, config].append(stats.mean_acceptance_length)
                if config == "adaptive":
                    widths[workload].update(stats.verifier["widths"])

    med = {key: statistics.median(v) for key, v in cpu.items()}
    wall = {key: statistics.median(v) for key, v in tps.items()}
    default = f"fixed{args.block}"
    fixed_names = [c for c in configs if c.startswith("fixed")]
    pair = f"shipped pair + {args.drafter}" if args.embedded else f"target hidden {args.hidden} x {args.layers} layers, planted {args.planted}"
    print(f"{pair}, block {args.block}, "
          f"{args.max_new_tokens} new tokens, {args.rounds} rounds, device {args.device}, {args.dtype}, threads {args.threads}")
    for title, table in (("tokens per CPU-second (median)", med), ("wall-clock decode tok/s (median)", wall)):
        print(f"\n{title}; mean acceptance length in brackets")
        print(f"{'workload':<12}" + "".join(f"{c:>12}" for c in configs))
        for w in workloads:
            print(f"{w:<12}" + "".join(f"{table[w, c]:>12.1f}" if c == "plain" else
                                         f"{table[w, c]:>7.1f}[{statistics.median(tau[w, c]):>4.1f}]" for c in configs))

    def paired(w: str, other: str) -> float:
        return statistics.median(a / b for a, b in zip(cpu[w, "adaptive"], cpu[w, other]))

    print(f"\n{'workload':<12}{'best fixed':>12}{'adapt/best':>12}{'adapt/default':>15}{'adapt/plain':>13}  adaptive widths (share >= 2 %)")
    results = {}
    for w in workloads:
        best = max(fixed_names, key=lambda c: med[w, c])
        total = sum(widths[w].values())
        shares = ", ".join(f"{k}:{v / total:.0%}" for k, v in sorted(widths[w].items()) if v / total >= 0.02)
        r = {"best_fixed": best, "adaptive_over_best": paired(w, best), "adaptive_over_default": paired(w, default),
             "adaptive_over_plain": paired(w, "plain")}
        results[w] = r
        print(f"{w:<12}{best:>12}{r['adaptive_over_best']:>12.3f}{r['adaptive_over_default']:>15.3f}"
              f"{r['adaptive_over_plain']:>13.3f}  {shares}")
    if args.json:
        args.json.write_text(json.dumps({
            "median_tokens_per_cpu_s": {f"{w}/{c}": v for (w, c), v in med.items()},
            "median_wall_decode_tok_s": {f"{w}/{c}": v for (w, c), v in wall.items()},
            "runs_tokens_per_cpu_s": {f"{w}/{c}": v for (w, c), v in cpu.items()},
            "ratios": results, "adaptive_widths": {w: dict(c) for w, c in widths.items()},
            "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
