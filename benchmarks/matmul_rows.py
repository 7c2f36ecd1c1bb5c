"""What a verify block costs against a one-token step, from the bottom: one projection's
matmul ``[rows, K] x [K, N]`` on PyTorch and on MLX, and a whole target forward of ``rows``
tokens over a KV cache (speculant's own target, per ``backend.compile`` setting), per number of rows.

    python benchmarks/matmul_rows.py [--rows 1,2,4,8,16] [--hidden 512] [--layers 8] [--repeats 30]

Speculation pays when a forward of ``w`` rows costs much less than ``w`` one-row forwards.
Medians of ``--repeats`` calls, milliseconds; ratios to one row are printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def line(name: str, costs: dict[int, float]) -> None:
    one = costs[min(costs)]
    cells = ", ".join(f"{rows}: {ms:.2f} ({ms / one:.1f}x)" for rows, ms in costs.items())
    print(f"  {name:34s} {cells}", flush=True)


def matmuls(rows: list[int], hidden: int, repeats: int) -> None:
    import mlx.core as mx
    import torch

    mx.set_default_device(mx.cpu)
    n = 3 * hidden  # an MLP projection's shape
    w_torch = torch.randn(n, hidden)
    w_mlx = mx.random.normal((n, hidden))
    w_mlx_t = mx.contiguous(w_mlx.T)  # the layout of backend.compile auto on MLX's CPU (layout.py)
    mx.eval(w_mlx, w_mlx_t)
    torch_costs, mlx_costs, mlx_t_costs = {}, {}, {}
    for r in rows:
        x_torch, x_mlx = torch.randn(r, hidden), mx.random.normal((r, hidden))
        mx.eval(x_mlx)
        torch_costs[r] = median_ms(lambda: torch.nn.functional.linear(x_torch, w_torch), repeats)  # noqa: B023
        mlx_costs[r] = median_ms(lambda: mx.eval(x_mlx @ w_mlx.T), repeats)  # noqa: B023
        mlx_t_costs[r] = median_ms(lambda: mx.eval(x_mlx @ w_mlx_t), repeats)  # noqa: B023
    print(f"matmul [rows, {hidden}] x [{hidden}, {n}], ms by rows (x one row):")
    line("torch F.linear", torch_costs)
    line("mlx x @ w.T (cpu)", mlx_costs)
    line("mlx x @ w_t, stored [in, out] (cpu)", mlx_t_costs)


def forwards(rows: list[int], hidden: int, layers: int, repeats: int) -> None:
    import torch

    import speculant
    from fast_path import mid_pair

    with tempfile.TemporaryDirectory() as tmp:
        target, _, prompt = mid_pair(Path(tmp), hidden, layers, 64)
        print(f"target forward over a 64-token cache, {hidden} x {layers} layers, ms by rows (x one row):")
        for kind, compile in (("torch", "off"), ("torch", "auto"), ("torch", "on"), ("mlx", "off"), ("mlx", "auto")):
            engine = speculant.load_engine({"backend": {"kind": kind, "device": "cpu", "dtype": "float32",
                                                        "compile": compile}, "target": {"path": str(target)}})
            model, ops = engine.target, engine.backend.ops
            model.reset()
            model.prefill(prompt)
            length = model.cache_length

            def step(r: int) -> None:
                out = model.forward(engine.backend.int_array(prompt[:r]))
                ops.to_numpy(out.logits[-1:])  # wait for it (MLX is lazy)
                model.crop(length)

            line(f"{kind} target, compile {compile}", {r: median_ms(lambda: step(r), repeats) for r in rows})  # noqa: B023
            del engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    matmuls(rows, args.hidden, args.repeats)
    forwards(rows, args.hidden, args.layers, args.repeats)


if __name__ == "__main__":
    main()
