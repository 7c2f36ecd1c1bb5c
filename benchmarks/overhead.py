"""Share of decode time spent outside target and draft forwards (scheduler, verification,
bookkeeping) for one generation on a ~50M-parameter random target on CPU.

    python benchmarks/overhead.py [--repeats 5] [--max-new-tokens 128] [--block-size 8]

Prints the median share over the repeats (target: <= 5 %).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def build(root: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    target = build_tiny_target(root / "target", seed=0, hidden_size=hidden, num_layers=layers, planted=7.5,
                               max_position_embeddings=4096)
    draft = build_tiny_dflash(root / "draft", target, seed=7, num_layers=2, block_size=16)
    return target, draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    import speculant

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = build(Path(tmp), args.hidden, args.layers)
        engine = speculant.load_engine({
            "backend": {"kind": "torch", "device": "cpu", "dtype": args.dtype},
            "target": {"path": str(target)},
            "drafter": {"kind": "dflash", "path": str(draft), "block_size": args.block_size},
        })
        engine.time_phases = True  # target_s / draft_s measured after a backend sync
        params = sum(p.numel() for p in engine.target.model.parameters())
        prompt = list(range(10, 74))
        engine.run(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)  # warm-up
        shares, taus, tps = [], [], []
        for _ in range(args.repeats):
            s = engine.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True).stats
            shares.append(s.overhead_s / s.decode_s)
            taus.append(s.mean_acceptance_length)
            tps.append(s.decode_tokens_per_s)
    print(f"target parameters: {params / 1e6:.1f}M, dtype {args.dtype}, threads {args.threads}, block {args.block_size}")
    print(f"mean acceptance length (median): {statistics.median(taus):.2f}")
    print(f"decode tok/s (median): {statistics.median(tps):.1f}")
    print(f"share of decode time outside target and draft forwards: median {statistics.median(shares) * 100:.2f} % "
          f"(runs: {', '.join(f'{x * 100:.2f}' for x in shares)})")


if __name__ == "__main__":
    main()
