"""Mixture-of-experts products on MLX's CPU: mlx-lm's ``SwitchLinear`` multiplies by its
[experts, out, in] weight seen transposed; speculant's ``TransposedSwitchLinear`` stores it
[experts, in, out]. Both run ``mx.gather_mm`` as ``SwitchGLU`` calls it (k experts per row),
interleaved per repeat; prints the median time ratio (as loaded / transposed) and the largest
difference between the two products.

    python benchmarks/expert_layout.py [--experts 32] [--hidden 512] [--intermediate 1024] [--k 4]
                                       [--rows 1,8,40] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4, help="experts per row")
    parser.add_argument("--rows", default="1,8,40")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    weight = mx.random.normal((args.experts, args.intermediate, args.hidden), key=mx.random.key(0))
    weight_t = mx.contiguous(weight.swapaxes(-1, -2))
    mx.eval(weight, weight_t)
    print(f"[{args.experts}, {args.intermediate}, {args.hidden}] float32, {args.k} experts per row, "
          f"medians of {args.repeats} interleaved repeats of 20 products")
    for rows in (int(r) for r in args.rows.split(",")):
        x = mx.random.normal((1, rows, 1, 1, args.hidden), key=mx.random.key(rows))
        indices = mx.random.randint(0, args.experts, (1, rows, args.k), key=mx.random.key(rows + 1))
        mx.eval(x, indices)
        loaded = lambda: mx.eval(mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=indices))  # noqa: E731
        stored = lambda: mx.eval(mx.gather_mm(x, weight_t, rhs_indices=indices))  # noqa: E731
        times: dict = {loaded: [], stored: []}
        for _ in range(args.repeats):
            for fn in times:
                start = time.perf_counter()
                for _ in range(20):
                    fn()
                times[fn].append(time.perf_counter() - start)
        diff = mx.abs(mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=indices)
                      - mx.gather_mm(x, weight_t, rhs_indices=indices)).max().item()
        ratio = statistics.median(times[loaded]) / statistics.median(times[stored])
        print(f"  {rows:3d} rows: as loaded / transposed {ratio:.2f}x, largest difference {diff:.1e}")


if __name__ == "__main__":
    main()
