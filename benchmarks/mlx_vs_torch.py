"""Plain decoding on MLX vs PyTorch (CPU), and DFlash speculative vs plain decoding on MLX, on a
~50M-parameter random Qwen3 target (planted so that drafts are accepted), measured side by side.

    python benchmarks/mlx_vs_torch.py [--repeats 3] [--max-new-tokens 64] [--block-sizes 4,8]
                                      [--dtype float32] [--threads 1] [--reference] [--synced]

Every repeat runs all configurations back to back in the same order, so drift on a shared
machine hits them alike; medians are reported. ``--reference`` also runs the official
``dflash.model_mlx`` loop and its own baseline (stock ``mlx_lm`` decoding) on the same weights
(needs the reference venv, see tests/reference/harness.py) and prints its speculative/plain
ratio next to speculant's. The reference runs in this process by default (its ``dflash`` package
imported from the reference venv onto this interpreter's identical mlx and mlx-lm), so both loops
run in one process state; ``--reference-subprocess`` runs it in the venv's own interpreter instead.
(The two used to differ by about 20 %: PyTorch's spinning OpenMP workers, which only this process
has, slowed every MLX run in it. ``OMP_WAIT_POLICY=PASSIVE``, set below, removed that.)
``--synced`` adds speculative rows that wait for MLX after every draft and target call
(``Engine.time_phases``, as the loop did before it overlapped them). Decode tok/s = (new tokens - 1) / time after the first token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# PyTorch's OpenMP workers spin after every op by default. MLX (and its BLAS) then share the two
# cores with idle spinners: measured here, MLX plain decoding fell from 30 to 24 tok/s and PyTorch
# (with OpenBLAS preloaded) from 27 to 8. Set before torch is imported, which starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def build(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    target = build_tiny_target(root / "target", seed=0, hidden_size=hidden, num_layers=layers, planted=7.5,
                               max_position_embeddings=4096)
    draft = build_tiny_dflash(root / "draft", target, seed=7, num_layers=2, block_size=16)
    return target, draft


def engine(kind: str, dtype: str, target: Path, draft: Path | None = None):
    import speculant

    config = {"backend": {"kind": kind, "device": "cpu", "dtype": dtype}, "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": "dflash", "path": str(draft)}
    return speculant.load_engine(config)


def reference_rates(target: Path, draft: Path, prompt: list[int], args, block: int) -> tuple[float, float, float]:
    """One run each of the reference's plain and speculative loops, timed as shipped (no
    recording wrapper): (plain tok/s, speculative tok/s, mean acceptance length)."""
    if str(ROOT / "tests") not in sys.path:  # called once per repeat
        sys.path.insert(0, str(ROOT / "tests"))
    from reference.harness import run_reference, run_reference_in_process

    run = run_reference if args.reference_subprocess else run_reference_in_process
    base = run("mlx", target, draft, prompt, args.max_new_tokens, block, baseline=True, timing=True)
    spec = run("mlx", target, draft, prompt, args.max_new_tokens, block, timing=True)
    rate = lambda out: (len(out["tokens"]) - 1) / out["decode_s"]  # noqa: E731
    return rate(base), rate(spec), statistics.mean(spec["acceptance_lengths"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-sizes", default="4,8", help="comma-separated runtime blocks for the MLX speculative runs")
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (MLX's CPU build uses one core)")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--reference", action="store_true", help="also time the reference dflash.model_mlx loop")
    parser.add_argument("--reference-subprocess", action="store_true",
                        help="with --reference: run it in the reference venv's own interpreter instead of this one")
    parser.add_argument("--synced", action="store_true", help="also time speculative runs that sync after every call")
    args = parser.parse_args()
    blocks = [int(b) for b in args.block_sizes.split(",")]

    import torch

    torch.set_num_threads(args.threads)
    prompt = [10 + i % 200 for i in range(args.prompt_length)]
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build(Path(tmp), args.hidden, args.layers)
        runs = {"torch plain": engine("torch", args.dtype, target), "mlx plain": engine("mlx", args.dtype, target)}
        spec = engine("mlx", args.dtype, target, draft)
        params = sum(p.numel() for p in runs["torch plain"].target.model.parameters())
        names = list(runs) + [f"mlx dflash b{b}" for b in blocks]
        if args.synced:
            names += [f"mlx dflash b{b} synced" for b in blocks]
        rates: dict[str, list[float]] = {name: [] for name in names}
        taus: dict[str, list[float]] = {name: [] for name in names}
        outputs: dict[str, list[int]] = {}
        refs: list[tuple[float, float, float]] = []
        kw = dict(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        for e in list(runs.values()) + [spec]:
            e.run(prompt_ids=prompt[:8], max_new_tokens=8, ignore_eos=True)  # warm-up
        for _ in range(args.repeats):
            for name in names:
                if name.startswith("mlx dflash"):
                    spec.time_phases = name.endswith("synced")
                    result = spec.run(block_size=int(name.split()[2][1:]), **kw)
                else:
                    result = runs[name].run(**kw)
                rates[name].append(result.stats.decode_tokens_per_s)
                taus[name].append(result.stats.mean_acceptance_length or 1.0)
                outputs.setdefault(name, result.token_ids)
            if args.reference:
                refs.append(reference_rates(target, draft, prompt, args, max(blocks)))

    median = {name: statistics.median(v) for name, v in rates.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(rates[a], rates[b]))  # noqa: E731  (per repeat)
    print(f"target: {params / 1e6:.1f}M parameters, {args.dtype}, prompt {len(prompt)} tokens, "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats, torch threads {args.threads}")
    for name in names:
        tau = f", mean acceptance length {statistics.median(taus[name]):.2f}" if "dflash" in name else ""
        print(f"  {name:16s} decode {median[name]:7.1f} tok/s (runs: {', '.join(f'{x:.1f}' for x in rates[name])}){tau}")
    print("ratios (median over repeats of the ratio within a repeat):")
    print(f"  MLX plain / torch plain: {ratio('mlx plain', 'torch plain'):.2f}")
    for b in blocks:
        print(f"  MLX dflash b{b} / MLX plain: {ratio(f'mlx dflash b{b}', 'mlx plain'):.2f}")
        if args.synced:
            print(f"  MLX dflash b{b} / the same synced after every call: {ratio(f'mlx dflash b{b}', f'mlx dflash b{b} synced'):.3f}")
    same = all(tokens == outputs["torch plain"] for tokens in outputs.values())
    print(f"identical tokens across all runs: {same}")
    if refs:
        b = max(blocks)
        ref_ratio = statistics.median(spec / base for base, spec, _ in refs)
        print(f"reference dflash.model_mlx b{b}: plain {statistics.median(r[0] for r in refs):.1f} tok/s, speculative "
              f"{statistics.median(r[1] for r in refs):.1f} tok/s (mean acceptance length {refs[0][2]:.2f}); "
              f"speculative/plain {ref_ratio:.2f} vs speculant's {ratio(f'mlx dflash b{b}', 'mlx plain'):.2f}")
        ours = statistics.median(rates[f"mlx dflash b{b}"])
        print(f"speculant / reference, speculative decode tok/s: {ours / statistics.median(r[1] for r in refs):.2f}")
        within = [(s / p) / (r[1] / r[0]) for s, p, r in zip(rates[f"mlx dflash b{b}"], rates["mlx plain"], refs)]
        print(f"speculant's speculative/plain over the reference's (median over repeats): {statistics.median(within):.2f} "
              f"(runs: {', '.join(f'{x:.2f}' for x in within)})")

if __name__ == "__main__":
    main()
