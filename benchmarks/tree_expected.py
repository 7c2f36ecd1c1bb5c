"""Expected acceptance of several tree shapes on the same drafts, paired (issue #40).

    python benchmarks/tree_expected.py [--pair tiny | --target DIR --draft DIR --data DATA_DIR]
        [--drafter dflash2] [--prompts 16] [--max-new-tokens 128] [--temperature 0.8]
        [--shape NAME=BUDGET[:CHAIN_BONUS] ...]   # CHAIN_BONUS: inf (default), a number, or off

Sampled runs of tree_acceptance.py compare arms on different texts (each run samples its own
continuation), so their means differ by more than the shapes do. Here one run decodes; at every
tree cycle each shape builds its tree from the same draft, the target runs the union of those
trees in one forward (a node's logits depend only on its path, so every shape's nodes are there),
and each shape's **expected** accepted length is computed exactly from the target's distributions
at its nodes: sum over its nodes of the probability that the walk reaches them (sample and match:
the target's probability of the child; at a node of the draft's sampled chain, min(1, p/q) for
the chain's child and the rejection's residual for the others). The chain's own expectation (the
sampled chain alone, speculative sampling) is reported beside them. The run itself verifies the
union tree by sample and match. Reported: mean expected accepted drafts per cycle + 1 (the
acceptance length), and its ratio to the chain's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import numpy as np

import speculant
from speculant.core.sampling import target_probs
from speculant.core.tree import DraftTree, with_branch
from speculant.verifiers.tree import TreeShape, draft_tree, tree_verify
from speculant.verifiers.tree_verifier import TreeVerifier


def expected_drafts(tree: DraftTree, probs: np.ndarray, node_of: list[int], sampled, q_rows) -> float:
    """Expected accepted drafts of ``tree`` whose node i has the target distribution
    ``probs[node_of[i]]``; ``sampled`` the draft's chain (a SampledPath, or None), ``q_rows`` [m, V]."""
    chain = {} if sampled is None else {n: j for j, n in enumerate(sampled.nodes[: sampled.tested])}
    children = tree.children()
    reach = np.zeros(tree.size)
    reach[0] = 1.0
    for n in range(tree.size):  # parents come first
        if reach[n] == 0.0 or not children[n]:
            continue
        p = probs[node_of[n]]
        if n in chain:
            j = chain[n]
            x = sampled.tokens[j]
            x_node = sampled.nodes[j + 1] if j + 1 < len(sampled.nodes) else None  # None: x emitted, the walk stops
            q = q_rows[j]
            accept = min(1.0, p[x] / q[x]) if q[x] > 0 else 0.0
            left = np.maximum(p - q, 0.0)
            left = left / left.sum() if left.sum() > 0 else p
            for token, child in children[n].items():
                reach[child] = reach[n] * (accept if child == x_node else (1.0 - accept) * left[token])
        else:
            for token, child in children[n].items():
                reach[child] = reach[n] * p[token]
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

    def __init__(self, shapes: dict[str, tuple[int, TreeShape]], width: int) -> None:
        super().__init__({"budget": max(b for b, _ in shapes.values()), "width": width})
        self.shapes, self.sums, self.chain_sum, self.cycles = shapes, {k: 0.0 for k in shapes}, 0.0, 0
        self.pending = None

    def tree(self, ops, draft, anchor_id, budget=None):
        if draft.logits is None or draft.num_tokens < 1:
            return None
        built = {name: draft_tree(ops, draft, anchor_id, b, self.width, shape) for name, (b, shape) in self.shapes.items()}
        union = DraftTree((anchor_id,), (-1,))
        for b in built.values():
            for leaf in b.tree.leaves():
                union, _ = with_branch(union, [b.tree.tokens[n] for n in b.tree.path_to(leaf)[1:]])
        chain = [int(t) for t in ops.to_list(draft.token_ids[: draft.num_tokens])]
        union, _ = with_branch(union, chain)
        self.pending = (built, draft, chain)
        self._sampled, self._branch, self._copy_nodes = None, None, []
        return union

    def verify_tree(self, ops, tree, target_logits, sampling, rng):
        built, draft, chain = self.pending
        probs = np.asarray(ops.to_list(target_probs(ops, target_logits[: tree.size], sampling)), dtype=np.float64)
        probs = probs / probs.sum(axis=1, keepdims=True)
        vocab = probs.shape[1]
        q = None
        if draft.draft_probs is not None:
            q = np.zeros((draft.num_tokens, vocab))
            values = np.asarray(ops.to_list(draft.draft_probs[: draft.num_tokens]), dtype=np.float64)
            ids = None if draft.candidate_ids is None else np.asarray(ops.to_list(draft.candidate_ids[: draft.num_tokens]))
            for j in range(draft.num_tokens):
                if ids is None:
                    q[j] = values[j]
                else:
                    np.add.at(q[j], ids[j].astype(int), values[j])
        union_children = tree.children()

        def node_map(t: DraftTree) -> list[int]:
            out = [0] * t.size
            for i in range(1, t.size):
                out[i] = union_children[out[t.parents[i]]][t.tokens[i]]
            return out

        for name, b in built.items():
            sampled = None if q is None else b.sampled
            self.sums[name] += expected_drafts(b.tree, probs, node_map(b.tree), sampled, q)
        chain_tree = DraftTree.chain([tree.tokens[0], *chain])
        rows = [probs[i] for i in node_map(chain_tree)[:-1]]
        self.chain_sum += chain_expected(rows, chain, q) if q is not None else sum(
            math.prod(r[x] for r, x in zip(rows[: k + 1], chain[: k + 1])) for k in range(len(chain)))
        self.cycles += 1
        return tree_verify(ops, tree, target_logits, sampling, rng)


def parse_shape(text: str) -> tuple[str, tuple[int, TreeShape]]:
    name, spec = text.split("=", 1)
    budget, _, bonus = spec.partition(":")
    chain_bonus = math.inf if bonus in ("", "inf") else (-math.inf if bonus == "off" else float(bonus))
    return name, (int(budget), TreeShape(chain_bonus=chain_bonus))


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
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", action="append", default=[], metavar="NAME=BUDGET[:CHAIN_BONUS]")
    args = p.parse_args()
    shapes = dict(parse_shape(s) for s in args.shape or ["B16=16", "B32=32", "B16_no_chain=16:off", "B32_no_chain=32:off"])
    if args.pair:
        from embedded_pair import held_out_prompts
        from speculant.embedded import PAIR_DIR

        args.target, args.draft = str(PAIR_DIR / "target"), str(PAIR_DIR / args.drafter)
        prompts = held_out_prompts(args.prompts)
    else:
        from transformers import AutoTokenizer

        from speculant.training.data import held_out_prompt_ids

        prompts = held_out_prompt_ids(args.data, AutoTokenizer.from_pretrained(args.target))[: args.prompts]
    engine = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                    "target": {"path": args.target},
                                    "drafter": {"kind": args.drafter, "path": args.draft},
                                    "verifier": {"kind": "tree"}})
    probe = engine.verifier = Probe(shapes, args.width)
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
