"""One batched verify over R sequences against R single-sequence verifies (issue #39).

For each row count R: R sequences of ``--context`` tokens join a batch (``BatchedTarget``); a
cycle verifies an anchor + ``--width - 1`` drafts per sequence in one forward and crops each back
by a different amount (so holes and compactions happen as in decoding). The baseline verifies the
same block R times, one after another, over the target's own single-sequence cache (its forward
and crop: today's loop, one request at a time). Medians of ``--cycles`` cycles after a warm-up;
a random Qwen3 target of the chosen size is built in a temporary folder.

    python benchmarks/batch_verify.py [--backend torch|mlx --device cpu --rows 1,4,8,16
                                       --width 4 --context 256 --hidden 256 --layers 4 --cycles 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from speculant.api import load_engine
from speculant.testing.tiny import build_tiny_target


def batch_for(engine, backend: str):
    if backend == "mlx":
        from speculant.backends.mlx.batch import MLXBatch

        return MLXBatch(engine.target)
    from speculant.backends.torch.batch import TorchBatch

    return TorchBatch(engine.target)


def timed(fn, cycles: int, sync) -> float:
    """Median seconds of ``fn`` after two warm-up calls."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(cycles):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batched_cycle(batch, width: int):
    def cycle():
        before = batch.lengths
        batch.verify([[7] * width for _ in before])
        batch.crop([b + 1 + (row % width) for row, b in enumerate(before)])  # a different acceptance per row

    return cycle


def solo_cycles(engine, rows: int, width: int):
    target, ops = engine.target, engine.backend

    def cycle():
        for row in range(rows):
            length = target.cache_length
            target.forward(ops.int_array([7] * width))
            target.crop(length)  # back to the same context: the solo baseline does not grow

    return cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = build_tiny_target(Path(folder) / "target", hidden_size=args.hidden, num_layers=args.layers,
                                 max_position_embeddings=args.context + 64 * args.cycles * args.width)
        backend = {"kind": args.backend, "device": args.device, "dtype": args.dtype, "compile": "off"}
        engine = load_engine({"backend": backend, "target": {"path": str(path)}})
        sync = engine.backend.synchronize
        prompt = [5 + i % 200 for i in range(args.context)]
        engine.target.reset()
        engine.target.prefill(prompt)
        print(f"{args.backend} {args.device} {args.dtype}: hidden {args.hidden}, {args.layers} layers, "
              f"context {args.context}, width {args.width}; median ms per cycle")
        for rows in [int(r) for r in args.rows.split(",")]:
            batch = batch_for(engine, args.backend)
            for row in range(rows):
                batch.join(row, prompt[: args.context - row])  # ragged contexts
            together = timed(batched_cycle(batch, args.width), args.cycles, sync)
            apart = timed(solo_cycles(engine, rows, args.width), args.cycles, sync)
            print(f"  rows {rows:3d}: batched {together * 1e3:8.2f}  one by one {apart * 1e3:8.2f}  "
                  f"speed-up {apart / together:5.2f}x")


if __name__ == "__main__":
    main()
