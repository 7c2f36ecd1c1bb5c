"""DFlash draft time per cycle against context length (PyTorch CPU): a random full-attention
draft (hidden 512, 5 layers) over random target features, so only the drafter's own work is timed.

    python benchmarks/draft_context.py [--contexts 256,4096,12000] [--cycles 30] [--threads 2]

Each cycle drafts a block of 8 and commits 4 rows, as decoding does; medians over the cycles
after the first five. Compare code versions side by side in one session (absolute times drift).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,4096,12000")
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    import speculant
    from speculant.core.types import DraftRequest, ForwardOutput
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp())
    target = build_tiny_target(root / "target", hidden_size=512, num_layers=6, max_position_embeddings=16384)
    draft = build_tiny_dflash(root / "draft", target, num_layers=5, block_size=8)
    engine = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                           "target": {"path": str(target)},
                                           "drafter": {"kind": "dflash", "path": str(draft)}})
    drafter = engine.drafter
    width = len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size
    for length in (int(c) for c in args.contexts.split(",")):
        drafter.prefill(list(range(length)), ForwardOutput(logits=None, features=torch.randn(length, width)), 5)
        times, position = [], length
        for _ in range(args.cycles):
            start = time.perf_counter()
            drafter.hidden(DraftRequest(5, position, 7))
            times.append(time.perf_counter() - start)
            drafter.commit(ForwardOutput(logits=None, features=torch.randn(8, width)), 4, [5] * 4)
            position += 4
        print(f"context {length}: draft {statistics.median(times[5:]) * 1e3:.2f} ms/cycle", flush=True)


if __name__ == "__main__":
    main()
