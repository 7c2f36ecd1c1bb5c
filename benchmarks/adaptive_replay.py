"""Replay the adaptive policy over recorded drafts: its decisions without the machine's noise.

    python benchmarks/adaptive_replay.py record [--prompts 24] [--max-new-tokens 128] [--out drafts.json]
    python benchmarks/adaptive_replay.py replay [--drafts drafts.json] [--seeds 7] [--set 6]
        [--target-ms 13.19,15.05,...] [--draft-ms 7.1,0.375] [--rest-ms 0.36] [--noise 0.05]

``record`` decodes the shipped pair's code prompts greedily (lookup off) and, at every output
position, keeps the drafter's whole block there (tokens and confidences): a cycle that always
drafts the whole block and submits nothing, so every position is a cycle start. ``replay`` then
runs the real ``AdaptivePolicy`` over those positions in sets of ``--set`` prompts, as
benchmarks/tree_speed.py runs it (one warm-up request, 3 repeats, state kept between requests),
with modelled costs: a target forward of width w takes ``target_ms[w - 1]``, a draft of L tokens
``a + b * L`` ms, both with lognormal noise. Greedy acceptance is exact: a cycle at position t
accepts the drafts that equal the recorded output. Prints, per set, the fixed full-block chain's
tokens/s and the policy's ratio to it over ``--seeds`` seeds. The default costs are the adaptive
verifier's own estimates on a 2-core AMD EPYC (AVX2), one thread, float32 (2026-12-05).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from speculant.core.types import CycleTiming
from speculant.verifiers.adaptive.options import AdaptiveOptions
from speculant.verifiers.adaptive.policy import AdaptivePolicy


def record(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import speculant
    from batch_generate import prompts_for
    from speculant import embedded
    from speculant.verifiers.adaptive import verifier as adaptive_verifier

    positions: list[dict] = []

    def plan(self, draft, max_tokens, context_length):  # every position a cycle start: submit nothing
        if draft is not None:
            positions[-1]["drafts"].append([int(x) for x in draft.token_ids.tolist()])
            positions[-1]["confidence"].append([float(c) for c in draft.confidence])
            positions[-1]["context"].append(context_length)
        return 0

    adaptive_verifier.AdaptiveVerifier.plan = plan
    AdaptivePolicy.wants_draft = lambda self, k, context_length: True
    AdaptivePolicy.draft_length = lambda self, k: k
    config = embedded.engine_config(backend="torch")
    config.setdefault("backend", {}).update({"kind": "torch", "dtype": "float32"})
    config["drafter"]["lookup"] = {"enabled": False}
    engine = speculant.load_engine({**config, "verifier": {"kind": "adaptive"}})
    for i, prompt in enumerate(prompts_for(args.prompts)):
        positions.append({"drafts": [], "confidence": [], "context": []})
        positions[-1]["output"] = list(engine.run(prompt=prompt, max_new_tokens=args.max_new_tokens, seed=i).token_ids)
    Path(args.out).write_text(json.dumps(positions))
    print(f"{len(positions)} prompts recorded to {args.out}")


class Costs:
    def __init__(self, args: argparse.Namespace, seed: int) -> None:
        self.target = [float(x) / 1e3 for x in args.target_ms.split(",")]
        self.draft = [float(x) / 1e3 for x in args.draft_ms.split(",")]
        self.rest, self.noise, self.rng = args.rest_ms / 1e3, args.noise, random.Random(seed)

    def target_s(self, width: int) -> float:
        return self.target[min(width, len(self.target)) - 1] * self.rng.lognormvariate(0, self.noise)

    def draft_s(self, length: int) -> float:
        return (self.draft[0] + self.draft[1] * length) * self.rng.lognormvariate(0, self.noise)


def accepted(request: dict, t: int, width: int) -> int:
    output, draft = request["output"], request["drafts"][t]
    a = 0
    while a < width and t + 1 + a < len(output) and draft[a] == output[t + 1 + a]:
        a += 1
    return a


class Chain:
    """The fixed chain, as a policy: every cycle drafts and submits the whole block."""

    def begin(self) -> None:
        pass

    def wants_draft(self, k: int, context_length: int) -> bool:
        return True

    def draft_length(self, k: int) -> int:
        return k

    def plan(self, drafted: int, k: int, context_length: int, confidence: list[float]) -> int:
        return k

    def observe(self, *cycle) -> None:
        pass


def decode(policy: AdaptivePolicy | Chain, requests: list[dict], costs: Costs, block: int) -> float:
    """Tokens per second of ``policy`` over ``requests``."""
    tokens, seconds = 0, 0.0
    for request in requests:
        output = request["output"]
        policy.begin()
        t = 0
        while t + 1 < len(output):
            k = min(block, len(output) - t - 2) if t < len(request["drafts"]) else 0
            context = request["context"][min(t, len(request["context"]) - 1)]
            if k <= 0 or not policy.wants_draft(k, context):
                target_s = costs.target_s(1)
                policy.observe(0, 0, CycleTiming(context, 0, 0, target_s, 0.0, costs.rest), 0.0, output[t + 1:t + 2])
                tokens, seconds, t = tokens + 1, seconds + target_s + costs.rest, t + 1
                continue
            length = min(k, max(1, policy.draft_length(k)))
            width = policy.plan(length, k, context, request["confidence"][t][:length])
            a = accepted(request, t, width)
            target_s, draft_s = costs.target_s(width + 1), costs.draft_s(length)
            timing = CycleTiming(context, width, length, target_s, draft_s, costs.rest)
            policy.observe(width, a, timing, 0.0, output[t + 1:t + a + 2])
            tokens, seconds, t = tokens + a + 1, seconds + target_s + draft_s + costs.rest, t + a + 1
    return tokens / seconds


def replay(args: argparse.Namespace) -> None:
    recorded = json.loads(Path(args.drafts).read_text())
    block = len(recorded[0]["drafts"][0])
    medians = []
    for start in range(0, len(recorded) - args.set + 1, args.set):
        requests = recorded[start:start + args.set]
        chain = statistics.median(decode(Chain(), requests, Costs(args, s), block) for s in range(3))
        ratios = []
        for seed in range(args.seeds):
            policy = AdaptivePolicy(AdaptiveOptions())
            decode(policy, requests[:1], Costs(args, seed + 99), block)  # the warm-up request
            costs = Costs(args, seed)
            ratios.append(statistics.median(decode(policy, requests, costs, block) for _ in range(3)) / chain)
        medians.append(statistics.median(ratios))
        print(json.dumps({"prompts": f"{start}-{start + args.set - 1}", "chain_tokens_per_s": round(chain, 1),
                          "adaptive_vs_chain": sorted(round(r, 3) for r in ratios)}))
    print(json.dumps({"median_of_sets": round(statistics.median(medians), 3), "worst_set_median": round(min(medians), 3)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["record", "replay"])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--set", type=int, default=6, help="prompts per replayed set")
    p.add_argument("--out", default="drafts.json")
    p.add_argument("--drafts", default="drafts.json")
    p.add_argument("--seeds", type=int, default=7)
    p.add_argument("--target-ms", default="13.19,15.05,16.02,15.96,17.10,16.89,17.59,17.83")
    p.add_argument("--draft-ms", default="7.1,0.375", help="a,b: a draft of L tokens costs a + b * L ms")
    p.add_argument("--rest-ms", type=float, default=0.36)
    p.add_argument("--noise", type=float, default=0.05)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    record(args) if args.mode == "record" else replay(args)


if __name__ == "__main__":
    main()
