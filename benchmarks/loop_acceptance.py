"""Where the shipped drafters lose acceptance: cycles inside loops of new content, inside loops
of content the drafters were trained on, and elsewhere.

    python benchmarks/loop_acceptance.py --training-sequences build/embedded-pair/sequences-32768.npy
        [--prompts 96] [--seed 99] [--max-new-tokens 128] [--drafters dflash,dflash2,mtp]
        [--draft dflash=PATH ...] [--threads 2]

Held-out prompts (64-token windows of files never trained on) are decoded greedily in float32 by
each drafter at a fixed width (block 8; MTP K = 2). Each cycle is classed by the 8 tokens ending
at its anchor:

- "new loop": they repeat an earlier 8-gram of the same prompt + output, but no training sequence
  holds them, so only copying from the context predicts what follows;
- "known loop": they repeat earlier and the training sequences hold them too, so memorising what
  the target wrote in training also works;
- "other": no earlier repeat.

``--training-sequences`` is the sequence file the drafts learned from (the build script's
stage 6 writes it; several files may be given). Greedy decoding is lossless, so every drafter
sees the same output and the classes cover the same positions.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from speculant.verifiers.adaptive.drift import RepeatWatch

N = RepeatWatch.SPAN  # the adaptive verifier's repeat rule, so "loop" means the same thing there


def ngram_hashes(rows: np.ndarray) -> np.ndarray:
    """[R, S] token ids -> [R, S - N + 1] 64-bit hashes of the N-grams (column j ends at j + N - 1)."""
    rows = rows.astype(np.uint64)
    width = rows.shape[1] - N + 1
    h = np.zeros((rows.shape[0], width), dtype=np.uint64)
    for k in range(N):
        h = h * np.uint64(1_000_003) + rows[:, k : k + width]
    return h


def anchor_classes(sequence: list[int], anchors: list[int], trained: np.ndarray) -> list[str]:
    """The class of each anchor position of ``sequence`` (see the module docstring); ``trained``:
    the sorted unique N-gram hashes of the training sequences."""
    watch = RepeatWatch()
    repeats = [watch.add([t]) for t in sequence]  # repeats[a]: the N tokens ending at a occurred earlier
    h = ngram_hashes(np.asarray([sequence]))[0]
    classes = []
    for a in anchors:
        if not repeats[a]:
            classes.append("other")
            continue
        i = np.searchsorted(trained, h[a - N + 1])  # ``trained`` is sorted (np.unique)
        classes.append("known loop" if i < len(trained) and trained[i] == h[a - N + 1] else "new loop")
    return classes


def engine(kind: str, path: str | None):
    import speculant
    from speculant import embedded

    config = embedded.engine_config(kind, backend="torch", lookup=False)  # the drafter's own proposals
    config["backend"]["dtype"] = "float32"
    config["verifier"] = {"kind": "auto"}
    config["drafter"]["block_size"] = 3 if kind == "mtp" else 8
    if path:
        config["drafter"]["path"] = path
    return speculant.load_engine(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training-sequences", nargs="+", required=True, type=Path)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--seed", type=int, default=99, help="held-out prompt seed (the speed benchmark's is 1234)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafters", default="dflash,dflash2,mtp")
    parser.add_argument("--draft", action="append", default=[], metavar="KIND=PATH",
                        help="measure this draft folder instead of the shipped one")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    torch.set_num_threads(args.threads)
    paths = dict(item.split("=", 1) for item in args.draft)
    trained = np.unique(np.concatenate([ngram_hashes(np.load(f)).ravel() for f in args.training_sequences]))
    prompts = [p.tolist() for p in corpus_prompts(PAIR_DIR / "target", args.prompts, 64, seed=args.seed, held_out=True)]
    names = ("new loop", "known loop", "other")
    print(f"{len(prompts)} held-out prompts (seed {args.seed}), {args.max_new_tokens} new tokens, float32, "
          f"training 8-grams from {', '.join(f.name for f in args.training_sequences)}")
    for kind in args.drafters.split(","):
        e = engine(kind, paths.get(kind))
        by_class: dict[str, list[int]] = {name: [] for name in names}
        for prompt in prompts:
            result = e.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=True)
            lengths = result.stats.acceptance_lengths
            anchors = [len(prompt) + sum(lengths[:i]) for i in range(len(lengths))]
            for cls, emitted in zip(anchor_classes(prompt + result.token_ids, anchors, trained), lengths):
                by_class[cls].append(emitted)
        cycles = sum(len(v) for v in by_class.values())
        overall = statistics.mean(x for v in by_class.values() for x in v)
        parts = [f"{name} {statistics.mean(v):.2f} ({len(v) / cycles:.0%} of cycles)" if v else f"{name} -"
                 for name, v in by_class.items()]
        label = kind if kind not in paths else f"{kind} ({paths[kind]})"
        print(f"  {label}: mean acceptance length {overall:.2f}; " + "; ".join(parts))


if __name__ == "__main__":
    main()
