"""Cost of exact rollback on a Gated DeltaNet hybrid (Qwen3.5 layout) on MLX, and the speed-up
speculation still gives with high acceptance.

    python benchmarks/rollback_cost_mlx.py [--hidden 256] [--layers 8] [--context 256] [--block 8]
                                           [--cycles 40] [--repeats 5] [--new 256] [--scale 0.1]

1. Rollback cost. At a fixed context, verify forwards of ``--block`` tokens are timed with and
   without recording (the per-position recurrent states and conv inputs that
   ``speculant.backends.mlx.caches`` keeps), and ``crop`` to a random accepted length inside the
   block is timed too (each step waits for MLX's lazy work). The cost per cycle is the
   recording's extra forward time plus the crop, as a share of the unrecorded verify forward
   (``rollback_share``: the median of the per-cycle shares; the other fields are medians).
   The caches are restored between cycles (untimed) so every cycle sees the same context.
2. Speed-up. ``Engine.run`` plain vs prompt lookup (``drafter.lookup``) on a repetitive prompt,
   interleaved, ``--repeats`` times; medians of tokens/s and of the per-repeat ratio, with the
   lookup run's mean acceptance length. Output equality is checked on every repeat.

Tiny random weights on a CPU: the shares are the meaningful part. ``--scale`` (of the random
weights) is small so the tiny model repeats itself and lookup acceptance is high.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build(root: Path, args) -> Path:
    from speculant.testing.tiny_families import build_tiny_family

    return build_tiny_family(root / "target", "qwen3_5", hidden_size=args.hidden, num_layers=args.layers,
                             max_position_embeddings=4096, scale=args.scale)


def engine_for(target: Path, lookup: bool, args):
    import speculant

    cfg = {"backend": {"kind": "mlx", "device": args.device, "dtype": "float32"}, "target": {"path": str(target)}}
    if lookup:
        cfg["drafter"] = {"kind": "none", "block_size": args.block,
                          "lookup": {"enabled": True, "min_match": 2, "max_match": 8}}
    return speculant.load_engine(cfg)


def snapshot(target) -> list:
    from speculant.backends.mlx.caches import DeltaCache, WindowKVCache

    saved = []
    for c in target.cache:
        if isinstance(c, DeltaCache):
            saved.append(list(c.cache))
        elif isinstance(c, WindowKVCache):
            saved.append((c.keys, c.values, c.offset, c.start))
        else:
            saved.append(c.offset)
    return [target._length, saved]


def restore(target, state) -> None:
    from speculant.backends.mlx.caches import DeltaCache, WindowKVCache

    target._length, saved = state
    for c, s in zip(target.cache, saved):
        if isinstance(c, DeltaCache):
            c.cache = list(s)
            c.forget()
        elif isinstance(c, WindowKVCache):
            c.keys, c.values, c.offset, c.start = s
        else:
            c.offset = s


def settle(*arrays) -> None:
    import mlx.core as mx

    mx.eval(*[a for a in arrays if a is not None])
    mx.synchronize()


def cache_arrays(target) -> list:
    from speculant.backends.mlx.caches import DeltaCache

    return [a for c in target.cache if isinstance(c, DeltaCache) for a in c.cache if a is not None]


def rollback_cost(target, args) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(5, 300, args.context)]
    target.reset()
    settle(target.prefill(prompt).logits)
    base = snapshot(target)
    delta_layers = target._delta_layers
    plain, recorded, crop = [], [], []
    for _ in range(args.cycles):
        block = target.backend.int_array([int(t) for t in rng.integers(5, 300, args.block)])
        kept = int(rng.integers(1, args.block))  # a partial acceptance: something to roll back

        target._delta_layers = []  # the same forward without recording
        t0 = time.perf_counter()
        settle(target.forward(block).logits)
        plain.append(time.perf_counter() - t0)
        target._delta_layers = delta_layers
        restore(target, base)

        t0 = time.perf_counter()
        settle(target.forward(block).logits)
        t1 = time.perf_counter()
        target.crop(args.context + kept)
        settle(*cache_arrays(target))
        t2 = time.perf_counter()
        recorded.append(t1 - t0)
        crop.append(t2 - t1)
        restore(target, base)
    p, r, c = (statistics.median(x) for x in (plain, recorded, crop))
    # shares per cycle (recorded and plain forwards of a cycle ran back to back), then their median
    share = statistics.median((ri - pi + ci) / pi for pi, ri, ci in zip(plain, recorded, crop))
    return {"verify_ms": p * 1e3, "verify_recorded_ms": r * 1e3, "crop_ms": c * 1e3,
            "recording_share": (r - p) / p, "crop_share": c / p, "rollback_share": share}


def speedup(target_path: Path, args) -> dict:
    plain, spec = engine_for(target_path, False, args), engine_for(target_path, True, args)
    unit = [7, 19, 42, 88, 123, 5, 250, 61, 33, 170, 9, 201]
    prompt = unit * max(1, args.context // len(unit))
    for e in (plain, spec):  # warm up (compilation, allocation)
        e.run(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)
    ratios, plain_tps, spec_tps, acceptance = [], [], [], []
    for _ in range(args.repeats):
        a = plain.run(prompt_ids=prompt, max_new_tokens=args.new, ignore_eos=True)
        b = spec.run(prompt_ids=prompt, max_new_tokens=args.new, ignore_eos=True)
        if a.token_ids != b.token_ids:
            raise SystemExit("speculative output differs from plain decoding")
        plain_tps.append(a.stats.decode_tokens_per_s)
        spec_tps.append(b.stats.decode_tokens_per_s)
        ratios.append(spec_tps[-1] / plain_tps[-1])
        acceptance.append(b.stats.mean_acceptance_length)
    return {"plain_tok_s": statistics.median(plain_tps), "lookup_tok_s": statistics.median(spec_tps),
            "speedup": statistics.median(ratios), "mean_acceptance_length": statistics.median(acceptance),
            "block": args.block}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--cycles", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target_path = build(Path(tmp), args)
        engine = engine_for(target_path, False, args)
        result = {"rollback": rollback_cost(engine.target, args), "speedup": speedup(target_path, args),
                  "settings": vars(args), "device": engine.backend.device}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
