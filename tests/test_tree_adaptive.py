"""The adaptive verifier's tree arms (``tree = "auto"``): it runs whichever of the chain and the
tree sizes emits the most tokens per second, switches when the costs change (hand-set costs), and
stays exact whichever it picks (greedy identity, chi-square at temperature 0.8)."""

from __future__ import annotations

import numpy as np
import pytest

from speculant.core.types import CycleTiming, Draft, Verification
from speculant.verifiers.adaptive import AdaptiveVerifier
from test_tree import NP, random_marginals

# fixed chain costs: the chain policy speculates from the first cycle (no warm-up, no fallback)
PINNED = {"cost_table": [1.0] * 9, "draft_cost": 0.1}


def drive(verifier: AdaptiveVerifier, cycles: int, seconds: dict[str, float]) -> list[str]:
    """Run the verifier's hooks, in the engine's order, for drafted cycles of 4 drafts: a chain
    cycle emits 2 tokens, a tree cycle 4, in ``seconds[arm]`` of target time. Returns the arms run."""
    logits = random_marginals(0, 4, 9)
    arms = []
    for _ in range(cycles):
        if not verifier.wants_draft(4, 100):
            continue
        draft = Draft(NP.argmax(logits), 4, logits=logits)
        n = verifier.plan(draft, 4, 100)
        if n == 0:
            continue
        tree = verifier.tree(NP, draft.truncated(n, NP), 1)
        arm = "chain" if tree is None else f"tree{tree.num_drafted}"
        verification = Verification(1, [1, 2]) if tree is None else Verification(3, [1, 2, 3, 4], (0, 1, 2, 3))
        verifier.observe(verification, n if tree is None else tree.num_drafted,
                         CycleTiming(100, n, 4, seconds[arm]))
        arms.append(arm)
    return arms


def test_adaptive_runs_the_fastest_arm_and_switches_when_costs_change():
    verifier = AdaptiveVerifier({**PINNED, "tree": "auto", "tree_budgets": [2, 8], "tree_explore_every": 4})
    # trees of 2 nodes: 4 tokens in 0.1 s (40/s); of 8 nodes: 4 in 0.4 s (10/s); chains: 2 in 0.1 s (20/s)
    costs = {"chain": 0.1, "tree2": 0.1, "tree8": 0.4}
    arms = drive(verifier, 48, costs)
    # tree8's first cycle puts it under half tree2's rate: no more warm-up runs, and no exploration
    # before the widest spacing (32 x 4 cycles)
    assert arms[:7].count("tree8") == 1 and arms.count("tree8") == 1
    steady = arms[7:]
    assert steady.count("tree2") >= 0.7 * len(steady) and "chain" in steady
    # small trees get expensive (4 tokens in 0.8 s, 5/s): the chain takes over, tree2 still
    # explored now and then (tree8, at half the chain's rate, waits for the widest spacing)
    run = drive(verifier, 80, {**costs, "tree2": 0.8})
    assert run[20:].count("chain") >= 0.8 * len(run[20:]) and "tree2" in run
    record = verifier.decisions()["tree"]
    assert record["choice"]["tokens_per_s"]["chain"] == pytest.approx(20.0, rel=0.01)
    assert "tree" in verifier.decisions()["actions"]


def test_trees_compete_with_the_plain_steps_of_a_chain_policy_gone_plain():
    """Chains accept nothing, so the chain policy falls back to plain steps (1 token in 0.1 s). A
    tree of 4 emits 4 tokens (its chain path: 1), first in 0.45 s (slower than plain), then in
    0.1 s: once an exploration measures that, trees must take over from the plain steps."""
    verifier = AdaptiveVerifier({**PINNED, "tree": "auto", "tree_budgets": [4], "tree_explore_every": 4})
    logits = random_marginals(0, 4, 9)
    kinds = []
    for cycle in range(120):
        draft = Draft(NP.argmax(logits), 4, logits=logits)
        n = verifier.plan(draft, 4, 100) if verifier.wants_draft(4, 100) else 0
        tree = verifier.tree(NP, draft.truncated(n, NP), 1) if n else None
        if tree is not None:
            verifier.observe(Verification(3, [1, 2, 3, 4], (0, 1, 2, 3), 0), tree.num_drafted,
                             CycleTiming(100, 4, 4, 0.45 if cycle < 40 else 0.1))
        else:
            verifier.observe(Verification(0, [5]), n, CycleTiming(100, n, 4 if n else 0, 0.1))
        kinds.append("tree" if tree is not None else "chain" if n else "plain")
    assert kinds[:40].count("plain") >= 20  # the policy went plain while trees were slower
    assert kinds[90:].count("tree") >= 0.8 * 30


def test_tree_off_and_drafts_without_distributions_verify_chains():
    off = AdaptiveVerifier({**PINNED, "tree": "off"})
    assert not AdaptiveVerifier(PINNED).builds_trees  # off by default (no measurable gain on a CPU: docs/tree-verification.md)
    assert not off.builds_trees and set(drive(off, 12, {"chain": 0.1})) == {"chain"}
    auto = AdaptiveVerifier({**PINNED, "tree": "auto"})
    draft = Draft(np.array([1, 2, 3]), 3)  # no per-position logits (an MTP or EAGLE draft)
    for _ in range(12):
        if auto.wants_draft(3, 100) and auto.plan(draft, 3, 100):
            assert auto.tree(NP, draft, 1) is None and auto.trees.arm in (None, "chain")
        auto.observe(Verification(1, [1, 2]), 3, CycleTiming(100, 3, 3, 0.1))
    # the first tree chosen found no distributions: trees are not chosen again
    assert auto.trees.no_distributions and sum(auto.trees.choice.chosen.values()) <= 4


def test_tree_options_are_checked():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="tree_budgets"):
        AdaptiveVerifier({"tree_budgets": [0]})
    with pytest.raises(ValidationError, match="tree"):
        AdaptiveVerifier({"tree": "always"})


# -- on a real DFlash pair (PyTorch) --------------------------------------------------------------

torch = pytest.importorskip("torch")

from test_tree_engine import (BACKEND, BACKEND_PARAMS, PROMPT, backend_config, plain_tokens,  # noqa: E402,F401
                              real_pair)


def adaptive_engine(pair, backend="torch", **options):
    import speculant

    verifier = {"kind": "adaptive", "options": {**PINNED, "tree": "auto", "tree_budgets": [4, 8], "tree_width": 3,
                                                "tree_explore_every": 2, **options}}
    return speculant.load_engine({"backend": backend_config(backend), "target": {"path": str(pair["target"])},
                                  "drafter": {"kind": "dflash", "path": str(pair["dflash"])}, "verifier": verifier})


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_adaptive_with_trees_equals_plain_greedy(real_pair, backend):
    plain = plain_tokens(real_pair["target"], backend)
    engine = adaptive_engine(real_pair, backend)
    trees = 0
    for _ in range(2):  # the choice carries over between requests
        result = engine.run(prompt_ids=PROMPT, max_new_tokens=len(plain), ignore_eos=True)
        assert result.token_ids == plain
        trees += result.stats.verifier["tree"]["trees"]
    record = result.stats.verifier["tree"]
    chosen = record["choice"]["chosen"]
    # every arm measured (once at least: an arm far behind after its first cycle stops warming), trees run
    assert min(chosen.values()) >= 1 and trees > 0, record


def test_adaptive_tree_cycles_follow_the_target_at_temperature_0_8(real_pair, fixed_loop_clock):
    """The first cycle after the prompt's first token (sampled plainly) is a chain or a tree, as the
    choice says; over the runs where it was a tree, its first token must fit the target's
    distribution at temperature 0.8 given each run's first token (and likewise for chains).

    The loop's clock ticks 1 ms a reading, so the choice (from the measured costs) and with it
    every run is fixed by the seeds: with wall-clock costs the arms changed from run to run and
    the test failed at the chi-square's loose tail about once in 300 runs."""
    import transformers

    from stats_helpers import gof_pvalue, reference_probs

    engine = adaptive_engine(real_pair)
    runs = []
    for seed in range(400):
        result = engine.run(prompt_ids=PROMPT, max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=seed)
        runs.append((result.token_ids, result.stats.verifier["actions"][0]))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(real_pair["target"]), dtype=torch.float32).eval()
    for arm in ("tree", "speculate"):
        pairs = [ids for ids, action in runs if action == arm]
        assert len(pairs) >= 100, (arm, len(pairs))
        firsts = sorted({p[0] for p in pairs})
        with torch.inference_mode():
            logits = model(torch.tensor([PROMPT + [t] for t in firsts])).logits[:, -1].float().numpy()
        counts = {t: sum(p[0] == t for p in pairs) for t in firsts}
        expected = sum(counts[t] * reference_probs(logits[i], 0.8) for i, t in enumerate(firsts)) / len(pairs)
        assert gof_pvalue(np.array([p[1] for p in pairs]), expected) > 1e-3, arm


# -- prompt lookup: the copy as one path of the tree ----------------------------------------------

def lookup_engine(pair, verifier):
    import speculant

    drafter = {"kind": "dflash", "path": str(pair["dflash"]), "lookup": {"enabled": True, "min_match": 2}}
    return speculant.load_engine({"backend": BACKEND, "target": {"path": str(pair["target"])},
                                  "drafter": drafter, "verifier": verifier})


def repetitive_prompt(pair) -> list[int]:
    """The prompt, what the target says after it, then the prompt again: a copy of what followed
    the prompt the first time is what the target says next."""
    said = plain_tokens(pair["target"])[:24]
    return PROMPT + said + PROMPT


@pytest.mark.parametrize("verifier", [{"kind": "tree", "options": {"budget": 4, "width": 2}},
                                      {"kind": "adaptive", "options": {**PINNED, "tree": "auto", "tree_budgets": [4]}}],
                         ids=["tree", "adaptive"])
def test_a_lookup_copy_is_a_path_of_the_tree_and_output_stays_plain(real_pair, verifier, monkeypatch):
    import speculant
    from speculant.verifiers import tree_verifier

    # beside a copy the chain runs no drafter: a tree's first cycle may put it under half the
    # chain's rate and end its warm-up; here every arm warms fully, so trees meet the copies
    monkeypatch.setattr(tree_verifier, "FAR_BEHIND", 0.0)

    prompt = repetitive_prompt(real_pair)
    plain = speculant.load_engine({"backend": BACKEND, "target": {"path": str(real_pair["target"])}}).run(
        prompt_ids=prompt, max_new_tokens=32, ignore_eos=True).token_ids
    engine = lookup_engine(real_pair, verifier)
    result = engine.run(prompt_ids=prompt, max_new_tokens=32, ignore_eos=True)
    assert result.token_ids == plain
    record = result.stats.verifier
    record = record["tree"] if verifier["kind"] == "adaptive" else record
    assert record["copy_branches"] > 0 and record["copy_nodes_accepted"] > 0, record


def test_a_copy_path_shares_the_nodes_it_has_in_common_and_appends_the_rest():
    from speculant.core.tree import DraftTree, with_branch

    tree = DraftTree((9, 1, 2, 3), (-1, 0, 0, 1))  # root 9; children 1, 2; 1 -> 3
    merged, added = with_branch(tree, [1, 3, 5, 6])
    assert merged.tokens[:4] == tree.tokens and merged.parents[:4] == tree.parents
    assert added == [4, 5] and merged.tokens[4:] == (5, 6) and merged.parents[4:] == (3, 4)
    assert [merged.tokens[n] for n in merged.path_to(5)] == [9, 1, 3, 5, 6]
    merged, added = with_branch(tree, [4])  # off the root
    assert added == [4] and merged.parents[4] == 0
    assert with_branch(tree, [2])[1] == []  # already a path: nothing added
