"""MTP draft cost per cycle as a fraction of a target forward, for K = 1..3 drafts.

    python benchmarks/mtp_cost.py [--backend torch|mlx] [--layout qwen|deepseek] [--cycles 60]
                                  [--hidden 64] [--layers 4] [--mtp-layers 1] [--context 128]
                                  [--compile auto|off] [--rows 4,16]

Builds a tiny Qwen3 target and MTP layers in its folder (a separate folder on MLX, whose Qwen3
loader is strict), prefills ``--context`` prompt tokens, then runs real greedy draft / verify /
commit cycles. Per cycle it times the drafter's work (``propose`` of K tokens plus ``commit`` of
the verified rows: the MTP layer over the committed positions, then K - 1 recursive steps and K
head projections) and the target's verify forward over K + 1 tokens. A one-token target forward
at the same context is timed too. Reports medians and the ratios draft / verify forward and
draft / one-token forward. Tiny models on a shared CPU: the ratios are the meaningful part, and
they overstate the MTP's share for real models, whose target has far more layers per MTP layer.

With ``--rows 4,16`` it times batched drafting instead (issue #39): that many forks of the
drafter, prefilled at contexts ``--context``, ``--context + 7``, ..., each propose K = 3 drafts
through ``propose_rows`` (one step per depth over all rows) and through the default that asks
each row in turn, interleaved; reports medians over ``--cycles`` repeats and checks both arms
drafted the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build(root: Path, args) -> tuple[Path, Path | None]:
    from speculant.testing.tiny import build_tiny_target
    from speculant.testing.tiny_mtp import build_tiny_mtp

    target = build_tiny_target(root / "target", seed=0, hidden_size=args.hidden, num_layers=args.layers,
                               max_position_embeddings=4096)
    folder = root / "mtp" if args.backend == "mlx" else None
    build_tiny_mtp(target, layout=args.layout, folder=folder, num_layers=args.mtp_layers, seed=1)
    return target, folder


def make_engine(args, target: Path, folder: Path | None):
    import speculant

    drafter = {"kind": "mtp", "block_size": 4}
    if folder is not None:
        drafter["path"] = str(folder)
    return speculant.load_engine({"backend": {"kind": args.backend, "device": args.device, "dtype": args.dtype,
                                              "compile": args.compile},
                                         "target": {"path": str(target)}, "drafter": drafter})


def settle(engine, *arrays) -> None:
    """Wait until ``arrays`` exist (MLX is lazy) and the device is idle."""
    if engine.backend.name == "mlx":
        import mlx.core as mx

        mx.eval(*[a for a in arrays if a is not None])
    engine.backend.synchronize()


def measure(engine, k: int, context: int, cycles: int) -> dict:
    from speculant.core.types import DraftRequest, SamplingParams

    target, drafter, ops, verifier = engine.target, engine.drafter, engine.backend.ops, engine.verifier
    capture = drafter.info.capture
    prompt = [20 + (i * 7) % 200 for i in range(context)]
    target.reset()
    out = target.prefill(prompt, capture)
    first = verifier.verify(ops, None, out.logits[-1:], SamplingParams(), None).token_ids[0]
    drafter.prefill(prompt, out, first)
    position, anchor = len(prompt), first
    draft_s, verify_s, single_s, accepted = [], [], [], 0
    for _ in range(cycles):
        t0 = time.perf_counter()
        draft = drafter.propose(DraftRequest(anchor, position, k))
        settle(engine, draft.token_ids)
        t1 = time.perf_counter()
        block = ops.concatenate([engine.backend.int_array([anchor]), draft.token_ids])
        result = target.forward(block, capture)
        settle(engine, result.logits, result.final_hidden)
        t2 = time.perf_counter()
        verification = verifier.verify(ops, draft, result.logits, SamplingParams(), None)
        target.crop(position + verification.accepted + 1)
        t3 = time.perf_counter()
        drafter.commit(result, verification.accepted + 1, verification.token_ids)
        settle(engine, drafter._head)
        t4 = time.perf_counter()
        draft_s.append((t1 - t0) + (t4 - t3))
        verify_s.append(t2 - t1)
        accepted += verification.accepted
        position += len(verification.token_ids)
        anchor = verification.token_ids[-1]
        # a one-token forward at the same context, rolled back
        t5 = time.perf_counter()
        single = target.forward(engine.backend.int_array([anchor]), capture)
        settle(engine, single.logits, single.final_hidden)
        single_s.append(time.perf_counter() - t5)
        target.crop(position)
    med = statistics.median
    return {
        "K": k,
        "draft_ms": 1e3 * med(draft_s),
        "verify_forward_ms": 1e3 * med(verify_s),
        "one_token_forward_ms": 1e3 * med(single_s),
        "draft_over_verify_forward": med(d / v for d, v in zip(draft_s, verify_s)),
        "draft_over_one_token_forward": med(draft_s) / med(single_s),
        "mean_accepted": accepted / cycles,
    }


def measure_rows(engine, rows: int, k: int, context: int, repeats: int) -> dict:
    """Median ms of ``rows`` forks' drafts in one ``propose_rows`` vs asked row by row."""
    from speculant.core.interfaces import Drafter
    from speculant.core.types import DraftRequest, SamplingParams

    target, drafter, ops, verifier = engine.target, engine.drafter, engine.backend.ops, engine.verifier
    forks = [drafter] + [drafter.fork() for _ in range(rows - 1)]
    requests = []
    for r, fork in enumerate(forks):
        prompt = [20 + (i * 7 + r) % 200 for i in range(context + 7 * r)]
        target.reset()
        out = target.prefill(prompt, drafter.info.capture)
        first = verifier.verify(ops, None, out.logits[-1:], SamplingParams(), None).token_ids[0]
        fork.prefill(prompt, out, first)
        requests.append(DraftRequest(first, len(prompt), k))
    arms = {"one_pass": drafter.propose_rows, "per_row": lambda ds, rs: Drafter.propose_rows(drafter, ds, rs)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list] = {}
    for _ in range(1 + repeats):  # the first round warms up
        for name, ask in arms.items():
            t0 = time.perf_counter()
            drafts = ask(forks, requests)
            settle(engine, *[d.token_ids for d in drafts])
            times[name].append(time.perf_counter() - t0)
            tokens[name] = [ops.to_list(d.token_ids) for d in drafts]
    if tokens["one_pass"] != tokens["per_row"]:
        raise SystemExit(f"propose_rows drafted {tokens['one_pass']}, row by row {tokens['per_row']}")
    one, per = (1e3 * statistics.median(times[name][1:]) for name in arms)
    return {"rows": rows, "K": k, "one_pass_ms": one, "per_row_ms": per, "per_row_over_one_pass": per / one}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch", choices=["torch", "mlx"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--layout", default="qwen", choices=["qwen", "deepseek"])
    parser.add_argument("--cycles", type=int, default=60)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mtp-layers", type=int, default=1)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--compile", default="auto", choices=["auto", "off"],
                        help="backend.compile (compiled MLX MTP steps draft row by row even in propose_rows)")
    parser.add_argument("--rows", default=None, help="e.g. 4,16: time propose_rows over that many forks instead")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.backend == "torch":
        import torch

        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        target, folder = build(Path(tmp), args)
        engine = make_engine(args, target, folder)
        if args.rows:
            return report_rows(args, [measure_rows(engine, int(n), 3, args.context, args.cycles) for n in args.rows.split(",")])
        measure(engine, 1, args.context, 5)  # warm-up
        rows = [measure(engine, k, args.context, args.cycles) for k in (1, 2, 3)]
    print(f"MTP draft cost per cycle ({args.backend}, {args.layout} layout, {args.mtp_layers} MTP layer(s); "
          f"target: hidden {args.hidden}, {args.layers} layers; context {args.context}; medians of {args.cycles} cycles)")
    print(f"{'K':>2} {'draft ms':>9} {'verify fwd ms':>14} {'1-token fwd ms':>15} {'draft/verify':>13} {'draft/1-token':>14} {'accepted':>9}")
    for r in rows:
        print(f"{r['K']:>2} {r['draft_ms']:>9.3f} {r['verify_forward_ms']:>14.3f} {r['one_token_forward_ms']:>15.3f} "
              f"{r['draft_over_verify_forward']:>13.3f} {r['draft_over_one_token_forward']:>14.3f} {r['mean_accepted']:>9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


def report_rows(args, rows: list[dict]) -> None:
    print(f"MTP drafts of several forks, one step per depth vs row by row ({args.backend}, {args.layout} layout, "
          f"{args.mtp_layers} MTP layer(s), hidden {args.hidden}, compile {args.compile}; contexts from {args.context}; K = 3; "
          f"medians of {args.cycles} repeats)")
    print(f"{'rows':>4} {'one pass ms':>12} {'per row ms':>11} {'per row / one pass':>19}")
    for r in rows:
        print(f"{r['rows']:>4} {r['one_pass_ms']:>12.3f} {r['per_row_ms']:>11.3f} {r['per_row_over_one_pass']:>19.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
