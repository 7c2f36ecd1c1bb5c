"""The CPU's linear-weight layouts on PyTorch (backends/torch/layouts.py): dense ``nn.Linear``,
stored transposed and packed for oneDNN, timed over a target's own layers two ways: one layer of
each shape (its weight hot in the core's caches), and every layer in turn, as a forward reads them.

    python benchmarks/cpu_layouts.py [--pairs shipped,mid] [--hidden 512] [--layers 8] [--threads 1]

Prints the median milliseconds of one pass per layout, on 1 row, on 8 rows, and on both (what
the load-time timing runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def median_ms(run, repeats: int = 9) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", default="shipped,mid")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from fast_path import mid_pair, shipped_pair
    from speculant.backends.torch.layouts import LAYOUTS
    from speculant.backends.torch.packed import linear_layers

    torch.set_num_threads(args.threads)
    for pair in args.pairs.split(","):
        target = (shipped_pair(64) if pair == "shipped"
                  else mid_pair(Path(tempfile.mkdtemp()), args.hidden, args.layers, 64))[0]
        model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        dense = [linear for *_, linear in linear_layers(model)]
        kinds = {"dense": dense} | {kind: [LAYOUTS[kind][0](d) for d in dense] for kind in LAYOUTS}
        xs = {(rows, d.in_features): torch.randn(rows, d.in_features) for d in dense for rows in (1, 8)}
        first = list({(d.in_features, d.out_features): i for i, d in reversed(list(enumerate(dense)))}.values())

        def run(layers, rows):
            return lambda: [layer(xs[r, layer.in_features]) for r in rows for layer in layers]

        size = sum(d.weight.numel() for d in dense) * 4 / 2**20
        print(f"{pair}: {len(dense)} linear layers, {size:.0f} MB, {args.threads} thread(s)")
        with torch.inference_mode():
            for rows in ((1,), (8,), (1, 8)):
                for name, pick in (("one layer per shape", first), ("every layer in turn", range(len(dense)))):
                    times = {kind: median_ms(run([layers[i] for i in pick], rows)) for kind, layers in kinds.items()}
                    print(f"  rows {rows}, {name:20s} " + "  ".join(f"{kind} {ms:.2f} ms" for kind, ms in times.items()))


if __name__ == "__main__":
    main()
