"""Cycle-time overhead of DFlash2 over DFlash on the same draft backbone (PyTorch, CPU).

Both drafts share every DFlash v1 tensor; the DFlash2 draft uses the published identity
initialisation (tap 0 = 1, zero kernel projection, zero successor codebook), so it proposes
exactly what DFlash proposes and both runs make the same cycles: the difference in time per
cycle is the cost of the two convolutions per layer, the selector's top-k and score table,
the one table transfer and the host walk. The runs alternate to share the machine's noise.

    python benchmarks/dflash2_overhead.py [--repeats 5] [--max-new-tokens 96] [--block-size 8]

Prints per-cycle times, the median of the paired runs' overheads and the ratio of the fastest
runs (target: <= 5 %; blog: about 1.3 %). On a shared CPU use several repeats.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


def build(root: Path, hidden: int, layers: int, draft_layers: int, block: int) -> dict[str, Path]:
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2, soften_target

    target = soften_target(build_tiny_target(root / "target", seed=0, hidden_size=hidden, num_layers=layers,
                                             planted=4.0, max_position_embeddings=4096), 0.5)
    kwargs = dict(seed=7, num_layers=draft_layers, block_size=block, sliding_window=2048)
    return {
        "target": target,
        "dflash": build_tiny_dflash(root / "dflash", target, extra_config={"is_causal": False}, **kwargs),
        "dflash2": build_tiny_dflash2(root / "dflash2", target, identity=True, selector_rank=64,
                                      selector_top_k=16, **kwargs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=640)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--propose-calls", type=int, default=200)
    args = parser.parse_args()

    import torch

    import speculant

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp), args.hidden, args.layers, args.draft_layers, args.block_size)
        engines = {kind: speculant.load_engine({
            "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
            "target": {"path": str(paths["target"])},
            "drafter": {"kind": kind, "path": str(paths[kind])},
        }) for kind in ("dflash", "dflash2")}
        for eng in engines.values():
            eng.time_phases = True  # draft_s measured after a backend sync
        prompt = list(range(10, 74))
        for eng in engines.values():
            eng.run(prompt_ids=prompt, max_new_tokens=16, ignore_eos=True)  # warm-up
        cycle = {kind: [] for kind in engines}
        draft = {kind: [] for kind in engines}
        tokens, taus = {}, {}
        for _ in range(args.repeats):
            for kind, eng in engines.items():
                result = eng.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
                s = result.stats
                cycle[kind].append(s.decode_s / s.verify_steps)
                draft[kind].append(s.draft_s / s.verify_steps)
                tokens[kind], taus[kind] = result.token_ids, s.mean_acceptance_length
        propose = time_proposals(engines, prompt, args.block_size - 1, args.propose_calls)
    if tokens["dflash"] != tokens["dflash2"]:
        raise SystemExit("identity DFlash2 did not reproduce DFlash's tokens; the comparison is void")
    overheads = [b / a - 1 for a, b in zip(cycle["dflash"], cycle["dflash2"])]
    print(f"target hidden {args.hidden} x {args.layers} layers, draft {args.draft_layers} layers, block "
          f"{args.block_size}, threads {args.threads}, mean acceptance length {taus['dflash']:.2f} (both)")
    for kind in engines:
        print(f"{kind:8s} cycle {statistics.median(cycle[kind]) * 1e3:7.2f} ms   "
              f"draft part {statistics.median(draft[kind]) * 1e3:6.2f} ms   (median of {args.repeats})")
    print(f"DFlash2 cycle-time overhead over DFlash: median of paired runs {statistics.median(overheads) * 100:+.2f} % "
          f"(runs: {', '.join(f'{x * 100:+.2f}' for x in overheads)})")
    extra = statistics.median(propose["dflash2"]) - statistics.median(propose["dflash"])
    print(f"propose() alone, {args.propose_calls} interleaved calls: dflash {statistics.median(propose['dflash']) * 1e3:.2f} ms, "
          f"dflash2 {statistics.median(propose['dflash2']) * 1e3:.2f} ms; the difference is "
          f"{extra / statistics.median(cycle['dflash']) * 100:+.2f} % of the DFlash cycle")


def time_proposals(engines, prompt, k, calls) -> dict[str, list[float]]:
    """Interleaved timings of ``propose`` on identical state (one new context row per call)."""
    import time

    from speculant.core.types import DraftRequest

    rows = {}
    for kind, eng in engines.items():
        eng.target.reset()
        out = eng.target.prefill(prompt, eng.drafter.info.capture)
        eng.drafter.prefill(prompt, out, prompt[-1])
        rows[kind] = out.features[-1:]
    times = {kind: [] for kind in engines}
    for i in range(calls):
        for kind, eng in engines.items():
            eng.drafter.pending = [rows[kind]]
            start = time.perf_counter()
            eng.drafter.propose(DraftRequest(prompt[-1], len(prompt) + i, k))
            times[kind].append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    main()
