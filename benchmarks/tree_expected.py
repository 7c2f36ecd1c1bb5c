"""Expected acceptance of several tree shapes on the same drafts, paired (issue #40).

    python benchmarks/tree_expected.py [--pair tiny | --target DIR --draft DIR --data DATA_DIR]
        [--drafter dflash2] [--prompts 16] [--max-new-tokens 128] [--temperature 0.8]
        [--shape NAME='{"budget": 32, "width": 8, "scores": "selector"}' ...]

Sampled runs of tree_acceptance.py compare arms on different texts (each run samples its own
continuation), so their means differ by more than the shapes do. Here one run decodes; at every
tree cycle each shape builds its tree from the same draft, the target runs the union of those
trees in one forward (a node's logits depend only on its path, so every shape's nodes are there),
and each shape's **expected** accepted length is computed exactly from the target's distributions
at its nodes: the sum over its nodes of the probability that sample and match reaches them (the
product of the target's probabilities of the path's tokens). The chain's own expectation (the
draft's chain verified alone by speculative sampling: min(1, p/q) per token, q one-hot for an
argmax chain) is reported beside them, so the ratio is the one issue #40 asks for, paired and
free of the sampling noise. The run itself verifies the union tree by sample and match.
Reported: mean expected accepted drafts per cycle + 1 (the acceptance length), its ratio to the
chain's, and the median of the per-prompt ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np

import speculant
from speculant.core.sampling import target_probs
from speculant.core.tree import DraftTree, with_branch
from speculant.verifiers.acceptance import draft_rows
from speculant.verifiers.tree import TreeShape, draft_tree, tree_verify
from speculant.verifiers.tree_verifier import TreeVerifier
from tree_acceptance import held_out


def expected_drafts(tree: DraftTree, probs: np.ndarray, node_of: list[int]) -> float:
    """Expected drafts sample and match accepts on ``tree``, whose node i has the target
    distribution ``probs[node_of[i]]``."""
    reach = np.zeros(tree.size)
    reach[0] = 1.0
    for n in range(1, tree.size):  # parents come first
        parent = tree.parents[n]
        reach[n] = reach[parent] * probs[node_of[parent]][tree.tokens[n]]
    return float(reach[1:].sum())


def chain_expected(p_rows: list[np.ndarray], tokens: list[int], q_rows) -> float:
    """Speculative sampling's expected accepted drafts over the chain ``tokens``."""
    total, alive = 0.0, 1.0
    for j, x in enumerate(tokens):
        q = q_rows[j][x]
        alive *= min(1.0, p_rows[j][x] / q) if q > 0 else 0.0
        total += alive
    return total


class Probe(TreeVerifier):
    """The `tree` verifier, building every shape's tree and verifying their union."""

    def __init__(self, shapes: dict[str, dict]) -> None:
        super().__init__()
        self.shapes, self.sums, self.chain_sum, self.cycles = shapes, {k: 0.0 for k in shapes}, 0.0, 0
        self.pending = None

    def tree(self, ops, draft, anchor_id, budget=None):
        if draft.logits is None or draft.num_tokens < 1:
            return None
        built = {name: draft_tree(ops, draft, anchor_id, o.get("budget", 16), o.get("width", 8),
                                  TreeShape(o.get("scores", "selector")))[0] for name, o in self.shapes.items()}
        union = DraftTree((anchor_id,), (-1,))
        for tree in built.values():
            for leaf in tree.leaves():
                union, _ = with_branch(union, [tree.tokens[n] for n in tree.path_to(leaf)[1:]])
        chain = [int(t) for t in ops.to_list(draft.token_ids[: draft.num_tokens])]
        union, _ = with_branch(union, chain)
        self.pending = (built, draft, chain)
        self._branch, self._copy_nodes = None, []
        return union

    def verify_tree(self, ops, tree, target_logits, sampling, rng):
        built, draft, chain = self.pending
        probs = np.asarray(ops.to_list(target_probs(ops, target_logits[: tree.size], sampling)), dtype=np.float64)
        probs = probs / probs.sum(axis=1, keepdims=True)
        k, ids = len(chain), draft.token_ids[: len(chain)]  # q of each chain token's row (one-hot: an argmax chain)
        q_probs = None if draft.draft_probs is None else draft.draft_probs[:k][None]
        q_ids = None if draft.candidate_ids is None else draft.candidate_ids[:k][None]
        q_rows = draft_rows(ops, ops.concatenate([ids, ids[-1:]]), q_probs, q_ids, (1, k, probs.shape[1]))
        q = np.asarray(ops.to_list(q_rows), dtype=np.float64)[:k]
        union_children = tree.children()

        def node_map(t: DraftTree) -> list[int]:
            out = [0] * t.size
            for i in range(1, t.size):
                out[i] = union_children[out[t.parents[i]]][t.tokens[i]]
            return out

        for name, built_tree in built.items():
            self.sums[name] += expected_drafts(built_tree, probs, node_map(built_tree))
        chain_tree = DraftTree.chain([tree.tokens[0], *chain])
        rows = [probs[i] for i in node_map(chain_tree)[:-1]]
        self.chain_sum += chain_expected(rows, chain, q)
        self.cycles += 1
        return tree_verify(ops, tree, target_logits, sampling, rng)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", choices=["tiny"])
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--data")
    p.add_argument("--drafter", default="dflash2")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", action="append", default=[], metavar="NAME=JSON",
                   help="a tree shape: its name and `tree` verifier options (budget, width, scores)")
    args = p.parse_args()
    if args.temperature <= 0:
        p.error("--temperature must be above 0 (greedy acceptance is not an expectation: use tree_acceptance.py)")
    shapes = {name: json.loads(options) for name, options in (s.split("=", 1) for s in args.shape)}
    shapes = shapes or {"B16": {"budget": 16}, "B32": {"budget": 32}}
    prompts = held_out(p, args)
    engine = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                    "target": {"path": args.target},
                                    "drafter": {"kind": args.drafter, "path": args.draft},
                                    "verifier": {"kind": "tree"}})
    probe = engine.verifier = Probe(shapes)
    per_prompt = []
    for i, ids in enumerate(prompts):
        before = (dict(probe.sums), probe.chain_sum, probe.cycles)
        engine.run(prompt_ids=ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed + i)
        n = probe.cycles - before[2]
        if n:
            per_prompt.append({k: (probe.sums[k] - before[0][k]) / n for k in shapes} | {"chain": (probe.chain_sum - before[1]) / n})
    chain = 1.0 + probe.chain_sum / probe.cycles
    report = {"cycles": probe.cycles, "prompts": len(prompts), "temperature": args.temperature,
              "chain_acceptance_length": round(chain, 3)}
    for name in shapes:
        tau = 1.0 + probe.sums[name] / probe.cycles
        ratios = [(1.0 + r[name]) / (1.0 + r["chain"]) for r in per_prompt]
        report[name] = {"acceptance_length": round(tau, 3), "vs_chain": round(tau / chain, 3),
                        "median_prompt_vs_chain": round(statistics.median(ratios), 3)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
