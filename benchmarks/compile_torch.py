"""PyTorch ``backend.compile``: eager against compiled forwards on the shipped pair, plain and
DFlash-speculative decoding, beside transformers' own ``generate`` on the same target.

    python benchmarks/compile_torch.py [--dtype bfloat16] [--repeats 5] [--max-new-tokens 128]
                                       [--threads 2] [--block-size 8]

Every repeat runs all arms back to back on the same held-out prompt (machine drift hits them
alike); medians over repeats are printed, with each arm's ratio to eager plain decoding. Decode
tok/s counts the tokens after the first over the time after it; for ``generate`` that time is
``t(N new tokens) - t(1 new token)``, both measured in the same repeat. The compiled engines are
warmed first (every width bucket of the block), and their compile seconds are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# PyTorch's OpenMP workers spin after every op by default: on a shared machine that starves them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=8)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import speculant
    from speculant import embedded

    torch.set_num_threads(args.threads)
    prompt = held_out_prompt()

    def engine(drafter: str | None, compile: str):
        config = embedded.engine_config(drafter, backend="torch", lookup=False)
        config["backend"].update({"dtype": args.dtype, "device": "cpu", "compile": compile})
        config["verifier"] = {"kind": "auto"}  # full blocks, like the reference loop
        if drafter:
            config["drafter"]["block_size"] = args.block_size
        made = speculant.load_engine(config)
        started = time.perf_counter()
        capture = made.drafter.info.capture if made.drafter is not None else None
        made.target.warm_up(args.block_size if drafter else 1, *(() if capture is None else (capture,)))
        print(f"{drafter or 'plain'} compile={compile}: warm-up {time.perf_counter() - started:.1f} s; "
              f"{made.target.fast_path}", flush=True)
        return made

    arms = {f"{name} {mode}": engine(drafter, mode) for name, drafter in (("plain", None), ("dflash", "dflash"))
            for mode in ("off", "on")}
    model = AutoModelForCausalLM.from_pretrained(str(embedded.PAIR_DIR / "target"), dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor([prompt])

    def generate(n: int) -> tuple[float, list[int]]:
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - started, out[0, len(prompt):].tolist()

    for made in arms.values():  # first-call costs stay out of the timings
        made.run(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)
    generate(4)
    def greedy_steps(n: int) -> tuple[float, list[int]]:
        """The compiled plain target's ``greedy_steps`` loop (what a pipelining engine would run)."""
        target = arms["plain on"].target
        target.reset()
        first = int(torch.argmax(target.prefill(prompt).logits[-1]))
        started = time.perf_counter()
        steps = target.greedy_steps(first)
        produced = [first] + [next(steps) for _ in range(n - 1)]
        steps.close()
        return (n - 1) / (time.perf_counter() - started), produced

    rates: dict[str, list[float]] = {name: [] for name in [*arms, "plain on greedy_steps", "transformers generate"]}
    tokens: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for name, made in arms.items():
            result = made.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            rates[name].append(result.stats.decode_tokens_per_s)
            tokens[name] = result.token_ids
        rate, tokens["plain on greedy_steps"] = greedy_steps(args.max_new_tokens)
        rates["plain on greedy_steps"].append(rate)
        full, tokens["transformers generate"] = generate(args.max_new_tokens)
        first, _ = generate(1)
        rates["transformers generate"].append((args.max_new_tokens - 1) / (full - first))
        print(f"repeat {repeat + 1}: " + ", ".join(f"{n} {r[-1]:.0f}" for n, r in rates.items()), flush=True)
    report(args, rates, tokens, arms)


def held_out_prompt(length: int = 64) -> list[int]:
    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    return corpus_prompts(PAIR_DIR / "target", 1, length, seed=1234, held_out=True)[0].tolist()


def report(args, rates: dict[str, list[float]], tokens: dict[str, list[int]], arms: dict) -> None:
    base = rates["plain off"]
    print(f"shipped pair, torch {args.dtype}, {args.threads} threads, block {args.block_size}, "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats (medians)")
    print(f"{'arm':<24}{'tok/s':>9}{'x plain eager':>15}{'same tokens':>13}  fast path")
    for name, values in rates.items():
        ratio = statistics.median(v / b for v, b in zip(values, base))
        same = tokens[name] == tokens["plain off"]
        fast = arms[name].target.fast_path if name in arms else ""
        print(f"{name:<24}{statistics.median(values):>9.1f}{ratio:>14.2f}x{str(same):>13}  {fast}")


if __name__ == "__main__":
    main()
