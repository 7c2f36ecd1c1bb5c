"""The ``tree`` verifier on PyTorch and MLX targets: greedy identity with plain greedy on dense and
sliding-window targets (with branches the chain does not have), a commit that keeps a sibling's
rows breaking it, the hybrid fallback to chains, and chi-square at temperature 0.8 (PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.api import load_engine, validate  # noqa: E402
from speculant.core.tree import GATHER  # noqa: E402
from speculant.testing.planted_drafter import registry_with_planted  # noqa: E402
from speculant.testing.tiny import build_tiny_target  # noqa: E402
from speculant.testing.tiny_families import build_tiny_family  # noqa: E402
from stats_helpers import gof_pvalue, reference_probs  # noqa: E402

BACKEND = {"kind": "torch", "device": "cpu", "dtype": "float32"}
# MLX's whole compiled forward runs over a static cache that takes no tree: eager forwards
BACKENDS = {"torch": BACKEND, "mlx": {**BACKEND, "kind": "mlx", "compile": "off"}}
BACKEND_PARAMS = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]
PROMPT = list(range(5, 15))
NEW = 48  # crosses the sliding window (16) of the sliding families
MISTAKES = [2, 0, -1, 4, 1]  # the planted drafter's spoiled block position per cycle
TREE = {"kind": "tree", "options": {"budget": 12, "width": 2}}
# dense, all sliding, sliding + full (Gemma 3; gpt-oss with sinks; Muse Glimmer without rope on full layers)
TARGETS = ("qwen3", "mistral", "gemma3_text", "gpt_oss", "muse_glimmer")


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return tiny_targets


def backend_config(name: str) -> dict:
    if name == "mlx":
        pytest.importorskip("mlx.core")
        pytest.importorskip("mlx_lm")
    return BACKENDS[name]


def plain_tokens(path, backend="torch") -> list[int]:
    engine = load_engine({"backend": backend_config(backend), "target": {"path": str(path)}})
    return engine.run(prompt_ids=PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids


def planted(path, script, verifier=None, backend="torch", **options):
    drafter = {"kind": "planted", "options": {"script": script, "mistakes": MISTAKES, **options}, "block_size": 8}
    config = {"backend": backend_config(backend), "target": {"path": str(path)}, "drafter": drafter}
    if verifier is not None:
        config["verifier"] = verifier
    return load_engine(config, registry=registry_with_planted())


def run(engine):
    return engine.run(prompt_ids=PROMPT, max_new_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", TARGETS)
def test_tree_greedy_equals_plain_and_recovers_planted_mistakes_through_branches(targets, name, backend):
    path = targets(name)
    plain = plain_tokens(path, backend)
    script = [[PROMPT, plain]]
    tree = run(planted(path, script, TREE, backend))
    assert tree.token_ids == plain
    record = tree.stats.verifier
    assert record["trees"] > 0 and "fallback" not in record
    assert sum(record["branch_used_per_depth"]) > 0, record  # the accepted path left the chain
    chain = run(planted(path, script, backend=backend))
    assert chain.token_ids == plain
    assert tree.stats.verify_steps < chain.stats.verify_steps  # the branches saved cycles


@pytest.mark.parametrize("name", ("qwen3", "gemma3_text"))
def test_the_drafter_gets_the_target_states_of_the_accepted_path(targets, name):
    """The rows committed to the drafter after each tree are the accepted path's, in order: equal to
    the target's hidden states over the whole output as transformers computes them."""
    import json

    import transformers

    path = targets(name)
    plain = plain_tokens(path)
    engine = planted(path, [[PROMPT, plain]], TREE, target_layer_ids=[0, 2])
    rows = []
    prefill, commit = engine.drafter.prefill, engine.drafter.commit
    engine.drafter.prefill = lambda ids, out, first: (rows.append(out.features.clone()), prefill(ids, out, first))
    engine.drafter.commit = lambda out, n, ids: (rows.append(out.features[:n].clone()), commit(out, n, ids))
    result = run(engine)
    assert result.token_ids == plain and sum(result.stats.verifier["branch_used_per_depth"]) > 0
    features = torch.cat(rows)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([(PROMPT + plain)[: features.shape[0]]]), output_hidden_states=True).hidden_states
    H = hidden[0].shape[-1]
    for slot, layer in enumerate([0, 2]):
        torch.testing.assert_close(features[:, slot * H:(slot + 1) * H], hidden[layer + 1][0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", ("qwen3", "gemma3_text"))
def test_a_commit_that_keeps_a_siblings_rows_breaks_greedy_identity(targets, name, backend, monkeypatch):
    path = targets(name)
    plain = plain_tokens(path, backend)

    monkeypatch.setattr(GATHER, "keep", first_children)
    broken = run(planted(path, [[PROMPT, plain]], TREE, backend))
    assert broken.token_ids != plain


HYBRIDS = ("qwen3_next", "qwen3_5")  # Gated DeltaNet 3 : 1 full attention


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory, torch_threads):
    root = tmp_path_factory.mktemp("tree_hybrids")
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny_family(root / name, name)
        return built[name]

    return get


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_trees_equal_plain_greedy(hybrids, name, backend):
    """Each node's convolution reads its ancestors and its delta rule starts from its parent's state."""
    path = hybrids(name)
    plain = plain_tokens(path, backend)
    result = run(planted(path, [[PROMPT, plain]], TREE, backend))
    assert result.token_ids == plain
    record = result.stats.verifier
    assert record["trees"] > 0 and sum(record["branch_used_per_depth"]) > 0 and "fallback" not in record


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("prompt", [[40], [40, 41]])
def test_hybrid_trees_from_a_context_shorter_than_the_convolution(hybrids, prompt, backend):
    """The first tree after a 1- or 2-token prompt reads fewer cached convolution inputs than the
    kernel (4) needs; the missing ones are zeros, as for a chain (a campaign found PyTorch raising
    "the cached convolution window is shorter than the kernel" there)."""
    path = hybrids("qwen3_5")
    engine = load_engine({"backend": backend_config(backend), "target": {"path": str(path)}})
    plain = engine.run(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True).token_ids
    result = planted(path, [[prompt, plain + [0] * 8]], TREE, backend).run(prompt_ids=prompt, max_new_tokens=12,
                                                                          ignore_eos=True)
    assert result.token_ids == plain and result.stats.verifier["trees"] > 0


def commit_of(backend: str):
    """(module, name) of the backend's Gated DeltaNet commit: (cache or layer, states, width, rows)."""
    if backend == "torch":
        from speculant.backends.torch import tree as torch_tree

        return torch_tree, "_commit_linear"
    from speculant.backends.mlx import tree as mlx_tree

    return mlx_tree, "_commit_delta"


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_a_hybrid_commit_that_keeps_the_wrong_nodes_state_breaks_greedy_identity(hybrids, backend, monkeypatch):
    path = hybrids("qwen3_next")
    plain = plain_tokens(path, backend)
    module, name = commit_of(backend)
    commit = getattr(module, name)

    def parents_state(layer, *args):
        """The recurrent state of the path's second-last node (its parent) instead of its last."""
        rows = args[-1]
        states = layer.states if backend == "mlx" else args[0]
        if states is not None and len(rows) > 1:
            swapped = list(states)
            swapped[rows[-1]] = states[rows[-2]]
            if backend == "mlx":
                layer.states = swapped
            else:
                args = (swapped, *args[1:])
        return commit(layer, *args)

    monkeypatch.setattr(module, name, parents_state)
    assert run(planted(path, [[PROMPT, plain]], TREE, backend)).token_ids != plain
    monkeypatch.undo()
    monkeypatch.setattr(GATHER, "keep", first_children)
    assert run(planted(path, [[PROMPT, plain]], TREE, backend)).token_ids != plain  # a sibling's inputs and state


def compiled_engine(path, script, verifier=TREE):
    drafter = {"kind": "planted", "options": {"script": script, "mistakes": MISTAKES}, "block_size": 8}
    config = {"backend": {**backend_config("mlx"), "compile": "auto"}, "target": {"path": str(path)},
              "drafter": drafter, "verifier": verifier}
    engine = load_engine(config, registry=registry_with_planted())
    if not engine.target.compiles_whole:
        pytest.skip(f"the whole forward is not compiled here: {engine.target.fast_path}")
    return engine


def compiled_plain(path) -> list[int]:
    engine = load_engine({"backend": {**backend_config("mlx"), "compile": "auto"}, "target": {"path": str(path)}})
    return engine.run(prompt_ids=PROMPT, max_new_tokens=NEW, ignore_eos=True).token_ids


def first_children(tree, accepted):
    """The accepted path with every node replaced by its parent's first child (the chain's node)."""
    return [0] + [min(tree.children()[tree.parents[n]].values()) for n in accepted[1:]]


@pytest.mark.mlx
@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma3_text", "qwen3_next"])
def test_trees_over_the_compiled_static_path_equal_plain_greedy(targets, hybrids, name, monkeypatch):
    """MLX's whole compiled forward (backend.compile = auto on the CPU) runs a tree eagerly over its
    static buffers: full-attention rows (row = position), sliding rings (row = position modulo the
    ring, across the window), Gated DeltaNet states. Greedy output equals plain greedy (on the
    same path), with branches used; a commit that keeps the first child's rows breaks it."""
    path = hybrids(name) if name == "qwen3_next" else targets(name)
    plain = compiled_plain(path)
    result = run(compiled_engine(path, [[PROMPT, plain]]))
    assert result.token_ids == plain
    record = result.stats.verifier
    assert record["trees"] > 0 and "fallback" not in record and sum(record["branch_used_per_depth"]) > 0, record
    monkeypatch.setattr(GATHER, "keep", first_children)
    assert run(compiled_engine(path, [[PROMPT, plain]])).token_ids != plain


@pytest.mark.mlx
def test_a_ring_mask_that_ignores_the_window_breaks_greedy_identity(targets, monkeypatch):
    from speculant.backends.mlx import tree as mlx_tree

    path = targets("mistral")
    plain = compiled_plain(path)
    ring = mlx_tree._ring_mask_of

    def windowless(cache, tree):
        make_mask = ring(cache, tree)

        def without_window(*args, **kwargs):
            window, cache.window = cache.window, 10**9
            try:
                return make_mask(*args, **kwargs)
            finally:
                cache.window = window

        return without_window

    monkeypatch.setattr(mlx_tree, "_ring_mask_of", windowless)
    assert run(compiled_engine(path, [[PROMPT, plain]])).token_ids != plain


def test_the_validator_warns_when_a_backend_takes_no_tree(tmp_path):
    """A backend without tree forwards (the default of Backend.tree_problem) gets a warning on
    verifier.kind, naming the reason; the built-in backends take every layer kind they roll back."""
    from speculant.backends.torch.backend import TorchBackend
    from speculant.core.interfaces import Backend

    path = build_tiny_target(tmp_path / "target")
    registry = registry_with_planted()

    class Treeless(TorchBackend):
        tree_problem = classmethod(Backend.tree_problem.__func__)

    registry.backends["torch"] = Treeless
    drafter = {"kind": "planted", "options": {}, "block_size": 8}
    config = {"backend": BACKEND, "target": {"path": str(path)}, "drafter": drafter, "verifier": TREE}
    warned = [p for p in validate(config, registry=registry).warnings if p.field == "verifier.kind"]
    assert len(warned) == 1 and "no tree verify forward" in warned[0].message
    assert not [p for p in validate(config, registry=registry_with_planted()).warnings if p.field == "verifier.kind"]


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory, torch_threads):
    """A planted dense target with a DFlash and a DFlash2 draft (drafts partly accepted)."""
    from speculant.testing.tiny import build_tiny_dflash
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2

    root = tmp_path_factory.mktemp("tree_real_pair")
    target = build_tiny_target(root / "target", planted=7.5)
    return {"target": target, "dflash": build_tiny_dflash(root / "dflash", target, seed=7, block_size=8),
            "dflash2": build_tiny_dflash2(root / "dflash2", target, seed=7, block_size=8, conv_scale=0.1)}


def real_engine(pair, kind, backend, budget=16, width=3, **shape):
    return speculant.load_engine({"backend": backend_config(backend), "target": {"path": str(pair["target"])},
                                  "drafter": {"kind": kind, "path": str(pair[kind])},
                                  "verifier": {"kind": "tree", "options": {"budget": budget, "width": width, **shape}}})


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_and_dflash2_trees_equal_plain_greedy(real_pair, kind, backend):
    plain = plain_tokens(real_pair["target"], backend)
    result = run(real_engine(real_pair, kind, backend))
    assert result.token_ids == plain
    record = result.stats.verifier
    assert record["trees"] > 0 and record["mean_accepted_depth"] > 0, record


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_dflash2_trees_shaped_by_its_marginals_equal_plain_greedy(real_pair, backend):
    """The default shapes DFlash2 trees by its path selector (the test above); the marginals too."""
    plain = plain_tokens(real_pair["target"], backend)
    shaped = real_engine(real_pair, "dflash2", backend, scores="marginal")
    result = run(shaped)
    assert result.token_ids == plain
    assert result.stats.verifier["trees"] > 0 and result.stats.verifier["mean_accepted_depth"] > 0


@pytest.mark.mlx
def test_dflash_trees_over_mlx_compiled_static_path_equal_plain_greedy(real_pair):
    backend = {**backend_config("mlx"), "compile": "auto"}
    target = {"path": str(real_pair["target"])}
    plain = load_engine({"backend": backend, "target": target}).run(prompt_ids=PROMPT, max_new_tokens=NEW,
                                                                    ignore_eos=True).token_ids
    engine = speculant.load_engine({"backend": backend, "target": target,
                                    "drafter": {"kind": "dflash", "path": str(real_pair["dflash"])},
                                    "verifier": {"kind": "tree", "options": {"budget": 16, "width": 3}}})
    if not engine.target.compiles_whole:
        pytest.skip(f"the whole forward is not compiled here: {engine.target.fast_path}")
    result = run(engine)
    assert result.token_ids == plain
    assert result.stats.verifier["trees"] > 0 and "fallback" not in result.stats.verifier


def test_a_measured_choice_between_tree_and_chain_stays_identical_to_plain(real_pair, fixed_loop_clock):
    """On the fixed clock which arm runs is fixed: with wall-clock costs a loaded machine could
    price one arm's first cycle far behind and stop measuring it."""
    plain = plain_tokens(real_pair["target"])
    engine = speculant.load_engine({"backend": BACKEND, "target": {"path": str(real_pair["target"])},
                                    "drafter": {"kind": "dflash", "path": str(real_pair["dflash"])},
                                    "verifier": {"kind": "tree",
                                                 "options": {"choose": "measured", "explore_every": 4}}})
    result = run(engine)
    assert result.token_ids == plain and result.stats.phases_timed
    chosen = result.stats.verifier["choice"]["chosen"]
    assert chosen["tree"] >= 3 and chosen["chain"] >= 3, chosen  # both measured


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_first_sampled_tree_tokens_follow_the_target_at_temperature_0_8(real_pair, backend):
    assert_second_token_follows_the_target(real_engine(real_pair, "dflash", backend, budget=8, width=3),
                                           real_pair["target"])


def test_first_sampled_tokens_of_selector_shaped_trees_follow_the_target_at_temperature_0_8(real_pair):
    engine = real_engine(real_pair, "dflash2", "torch", budget=8, width=3)  # shaped by the selector (default)
    assert_second_token_follows_the_target(engine, real_pair["target"])


def test_first_sampled_tree_tokens_of_a_hybrid_follow_the_target_at_temperature_0_8(tmp_path, torch_threads):
    from speculant.testing.tiny import build_tiny_dflash, plant_checkpoint

    target = build_tiny_family(tmp_path / "target", "qwen3_next")
    plant_checkpoint(target, strength=1.0)
    draft = build_tiny_dflash(tmp_path / "dflash", target, seed=7, target_layer_ids=[0, 2])
    assert_second_token_follows_the_target(real_engine({"target": target, "dflash": draft}, "dflash", "torch",
                                                       budget=8, width=3), target)


def assert_second_token_follows_the_target(engine, target):
    """The token after the prompt's first (sampled plainly) comes from a tree cycle: over all runs,
    its counts must fit the target's distributions at temperature 0.8 given each run's first token
    (the mixture of those distributions, weighted by how often each first token came)."""
    import transformers

    runs = [engine.run(prompt_ids=PROMPT, max_new_tokens=3, ignore_eos=True, temperature=0.8, seed=s)
            for s in range(500)]
    assert all(run.stats.verifier["trees"] > 0 for run in runs)  # the second token came out of a tree
    pairs = [run.token_ids for run in runs]
    firsts = sorted({p[0] for p in pairs})
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + [t] for t in firsts])).logits[:, -1].float().numpy()
    counts = {t: sum(p[0] == t for p in pairs) for t in firsts}
    expected = sum(counts[t] * reference_probs(logits[i], 0.8) for i, t in enumerate(firsts)) / len(pairs)
    assert gof_pvalue(np.array([p[1] for p in pairs]), expected) > 1e-3
