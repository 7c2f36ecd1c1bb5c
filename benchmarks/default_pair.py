"""The default engine (a pair's config with no flags) against plain decoding of the same target,
on chat prompts, side by side in one process.

    python benchmarks/default_pair.py [--pair smollm2] [--backend torch] [--max-new-tokens 128]
        [--repeats 3] [--threads 1,2] [--plain-compile auto,off] [--prompts-file prompts.json] [--prompts N]

Arms, run in turn in every repeat (order reversed every other repeat, so drift hits them alike):
``default`` (``pairs.engine_config(pair)``: today SmolLM2 with prompt lookup alone) and plain
decoding at each ``--plain-compile`` setting, each at every ``--threads`` count (PyTorch); the
ratio is the fastest default arm's median tokens/s over the fastest plain arm's. Every prompt is
wrapped in the chat template; greedy; tokens/s = new tokens / wall seconds, prefill included, over
all prompts. Every default run's tokens must equal the plain runs' (printed loudly otherwise; exit
status 1). ``--prompts-file``: a JSON list of strings, or the ``prompts.json`` of ``speculant train
data`` (its held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from speculant.bench.conditions import git_revision

PROMPTS = [
    "Write a Python function that adds two numbers.",
    "List the numbers from 1 to 20, one per line.",
    "Explain briefly what a dictionary is in Python.",
    "Name three fruits and say what colour each is.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
    "Give me a recipe for pancakes.",
    "Rewrite this sentence in the past tense: I walk to school and I eat an apple.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a bash command that counts the lines of every .py file in a folder.",
]


def load_prompts(path: str | None) -> list[str]:
    if not path:
        return PROMPTS
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):  # speculant train data's prompts.json
        return [p["text"] for p in data["held_out"]]
    return [str(p) for p in data]


def engines(args: argparse.Namespace) -> dict:
    import speculant
    from speculant import pairs

    config = pairs.engine_config(args.pair, backend=args.backend)
    config["backend"] = {**config["backend"], "dtype": "float32"}
    out = {"default": speculant.load_engine(config)}
    for compile_ in args.plain_compile:
        plain = {**config, "backend": {**config["backend"], "compile": compile_}, "drafter": {"kind": "none"}}
        out[f"plain {compile_}"] = speculant.load_engine(plain)
    return out


def run_arm(engine, threads: int, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]], float]:
    if engine.config.backend.kind == "torch":  # threads are the process's: set per arm
        import torch

        torch.set_num_threads(threads)
    started, tokens, results = time.perf_counter(), 0, []
    for ids in prompts:
        result = engine.run(prompt_ids=ids, max_new_tokens=n)
        tokens += len(result.token_ids)
        results.append(result)
    seconds = time.perf_counter() - started
    acceptance = [a for r in results for a in r.stats.acceptance_lengths]
    return tokens / seconds, [r.token_ids for r in results], sum(acceptance) / max(1, len(acceptance))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="smollm2")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default="1,2", help="plain arms' thread counts")
    parser.add_argument("--plain-compile", default="auto,off", help="plain arms' backend.compile settings")
    parser.add_argument("--prompts-file")
    parser.add_argument("--prompts", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",")]
    args.plain_compile = args.plain_compile.split(",")

    loaded = engines(args)
    arms = {f"{name} t{t}": (engine, t) for name, engine in loaded.items() for t in args.threads}
    tokenizer = loaded["default"].tokenizer
    texts = load_prompts(args.prompts_file)[:args.prompts]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in texts]
    for engine in loaded.values():  # warm-up: compiles, layouts, first allocations
        engine.run(prompt_ids=prompts[0], max_new_tokens=8)
    rates: dict[str, list[float]] = {name: [] for name in arms}
    outputs: dict[str, list[list[int]]] = {}
    acceptance = 0.0
    for repeat in range(args.repeats):
        for name in (list(arms) if repeat % 2 == 0 else list(arms)[::-1]):
            rate, outputs[name], mean = run_arm(*arms[name], prompts, args.max_new_tokens)
            rates[name].append(rate)
            acceptance = mean if name.startswith("default") else acceptance
            print(f"repeat {repeat}: {name}: {rate:.2f} tok/s", flush=True)
    reference = next(out for name, out in outputs.items() if not name.startswith("default"))
    mismatches = sum(a != b for out in outputs.values() for a, b in zip(out, reference))
    medians = {name: statistics.median(r) for name, r in rates.items()}
    plain = max((n for n in medians if not n.startswith("default")), key=medians.get)
    default = max((n for n in medians if n.startswith("default")), key=medians.get)
    revision = git_revision() or {"commit": "unknown", "dirty": None}
    row = {"commit": revision["commit"], "dirty": revision["dirty"], "date": time.strftime("%Y-%m-%d"),
           "pair": args.pair, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "medians_tok_s": medians,
           "fastest_plain": plain, "fastest_default": default, "speed_up": medians[default] / medians[plain],
           "mean_acceptance_length": acceptance, "mismatches": mismatches}
    for name, value in medians.items():
        print(f"{name:>16}: {value:7.2f} tok/s (median of {args.repeats})")
    print(f"fastest default ({default}) / fastest plain ({plain}): {row['speed_up']:.2f}x, "
          f"mean acceptance length {acceptance:.2f}")
    if mismatches:
        print(f"!!! {mismatches} outputs differ from plain greedy (last repeat, every arm)")
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=2))
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
