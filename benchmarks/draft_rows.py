"""Drafting several sequences: one ``propose`` per row against one ``propose_rows`` forward.

On the shipped pair's DFlash draft, over random target features so only the drafter's own work is
timed. ``--compile`` defaults to auto on PyTorch (on a CPU it packs the weights for oneDNN and
keeps the draft step eager) and off on MLX (auto compiles MLX's draft step on a CPU too, and a
compiled draft step makes ``propose_rows`` ask row by row).

    OMP_NUM_THREADS=1 python benchmarks/draft_rows.py [--backend torch|mlx] [--rows 1,4,16] [--calls 30]
        [--drafter dflash] [--compile auto|off]

Row r starts from a context of 96 + 37 r rows; every call commits 4 new rows to each sequence,
then drafts each a block (the pair's default size). Both ways run interleaved on their own forks
fed the same features; a call is timed until its tokens are on the host (MLX is lazy); medians
over the calls after the first five.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--drafter", default="dflash")
    parser.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    parser.add_argument("--compile", default=None, help="auto|off (default: auto on torch, off on mlx)")
    args = parser.parse_args()
    import numpy as np

    import speculant
    from speculant.core.interfaces import Drafter
    from speculant.core.types import DraftRequest, ForwardOutput
    from speculant.embedded import engine_config

    config = engine_config(args.drafter, args.backend, lookup=False)
    config["backend"]["compile"] = args.compile or ("off" if args.backend == "mlx" else "auto")
    engine = speculant.load_engine(config)
    drafter, ops = engine.drafter, engine.backend.ops
    width = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    k = (drafter.info.default_block_size or 8) - 1
    rng = np.random.default_rng(0)

    def randn(rows: int):
        return ops.asarray(rng.standard_normal((rows, width), dtype=np.float32))

    print(f"{args.drafter} on {args.backend}: block {k + 1}, fast_path {drafter.fast_path!r}, "
          f"{threads(args.backend)}")
    for n in (int(r) for r in args.rows.split(",")):
        ways = {"loop": lambda ds, rs: Drafter.propose_rows(ds[0], ds, rs), "rows": drafter.propose_rows}
        forks = {way: [drafter.fork() for _ in range(n)] for way in ways}
        positions = [96 + 37 * r for r in range(n)]
        starts = [randn(p) for p in positions]
        for way in ways:
            for fork, features in zip(forks[way], starts):
                fork.prefill([5] * features.shape[0], ForwardOutput(logits=None, features=features), 5)
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.calls):
            rows = [randn(4) for _ in range(n)]
            requests = [DraftRequest(5, p, k) for p in positions]
            for way, ask in ways.items():
                for fork, features in zip(forks[way], rows):
                    fork.commit(ForwardOutput(logits=None, features=features), 4, [5] * 4)
                start = time.perf_counter()
                [ops.to_list(d.token_ids) for d in ask(forks[way], requests)]
                times[way].append(time.perf_counter() - start)
            positions = [p + 4 for p in positions]
        loop, together = (statistics.median(times[w][5:]) * 1e3 for w in ways)
        print(f"rows {n:2d}: loop {loop:7.2f} ms  propose_rows {together:7.2f} ms  ({loop / together:.2f}x)", flush=True)


def threads(backend: str) -> str:
    if backend == "torch":
        import torch

        return f"torch threads {torch.get_num_threads()}"
    import os

    return f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"


if __name__ == "__main__":
    main()
