"""Drafters resumed from the prefix cache, on PyTorch and MLX: DFlash and DFlash2 take the stored context features of
the prefix (their pending rows), MTP rebuilds its cache from the stored final hidden states. A
resumed request drafts exactly as a cold one (the same acceptance length every cycle, drafts both
accepted and rejected) from the rows a cold prefill gives, and gives the cold tokens."""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.core import prefix_request  # noqa: E402
from speculant.testing.tiny import build_tiny_dflash, plant_checkpoint  # noqa: E402
from speculant.testing.tiny_dflash2 import build_tiny_dflash2  # noqa: E402
from speculant.testing.tiny_families import build_tiny_family  # noqa: E402
from speculant.testing.tiny_mtp import build_bigram_target  # noqa: E402
from speculant.testing.tiny_mtp_families import build_family_mtp  # noqa: E402

NEW = 64
HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
BACKENDS = ["torch", pytest.param("mlx", marks=[pytest.mark.mlx,
                                                 pytest.mark.skipif(not HAS_MLX, reason="needs mlx and mlx-lm")])]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, torch_threads):
    """(target, drafter config, prompt) per drafter kind, on the Qwen3.5 hybrid layout."""
    root = tmp_path_factory.mktemp("prefix_drafters")
    target = build_tiny_family(root / "target", "qwen3_5")
    plant_checkpoint(target, strength=1.0)
    mtp_target, cycle = build_bigram_target(root / "mtp", family="qwen3_5", hybrid=True, layer_scale=0.1)
    build_family_mtp(mtp_target, cycle=cycle, seed=3)
    rng = np.random.default_rng(7)
    mtp_prompt = [int(t) for t in rng.choice(cycle + list(range(20, 60)), size=40)]
    return {
        "dflash": (target, {"kind": "dflash", "path": str(build_tiny_dflash(root / "d1", target, seed=7,
                                                                              target_layer_ids=[0, 2]))},
                   [5, 6, 7, 8, 9] * 8),
        "dflash2": (target, {"kind": "dflash2", "path": str(build_tiny_dflash2(root / "d2", target, seed=7,
                                                                                target_layer_ids=[0, 2],
                                                                                conv_scale=0.1))},
                    [5, 6, 7, 8, 9] * 8),
        "mtp": (mtp_target, {"kind": "mtp", "block_size": 3}, mtp_prompt),
    }


def record_prefill(drafter) -> list:
    """Keep the rows the drafter's ``prefill`` is given (features, final hidden state)."""
    seen, prefill = [], drafter.prefill

    def recording(prompt_ids, output, first_token_id):
        seen.append([None if a is None else copy.deepcopy(a) for a in (output.features, output.final_hidden)])
        return prefill(prompt_ids, output, first_token_id)

    drafter.prefill = recording
    return seen


def resumed_and_cold(pairs, kind, backend):
    """(resumed result, cold result, largest difference between the rows their drafters started from)."""
    target, drafter, prompt = pairs[kind]
    config = {"kind": backend, "device": "cpu", "dtype": "float32"}
    engine = speculant.load_engine({"backend": config, "target": {"path": str(target)}, "drafter": drafter})
    rows = record_prefill(engine.drafter)
    block = {} if kind == "mtp" else {"block_size": 8}
    longer = prompt + [3, 4, 5, 6]
    cold = engine.run(prompt_ids=longer, max_new_tokens=NEW, ignore_eos=True, **block)
    engine.prefix_store.clear()
    engine.run(prompt_ids=prompt, max_new_tokens=1, ignore_eos=True, **block)
    resumed = engine.run(prompt_ids=longer, max_new_tokens=NEW, ignore_eos=True, **block)
    assert resumed.stats.cached_tokens == len(prompt)
    worst = max(float((a - b).abs().max()) for a, b in zip(rows[0], rows[2]) if a is not None)
    assert rows[0][0] is not None or rows[0][1] is not None
    return resumed, cold, worst


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "mtp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_drafter_drafts_as_a_cold_one(pairs, kind, backend):
    resumed, cold, worst = resumed_and_cold(pairs, kind, backend)
    assert worst < 1e-4  # rounding only: the drafter starts from the cold prefill's rows, the prefix's from the store
    assert resumed.token_ids == cold.token_ids
    lengths = cold.stats.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) > 1, lengths  # drafts rejected and accepted
    assert resumed.stats.acceptance_lengths == lengths


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_drafting_check_fails_without_the_prefix_rows(pairs, kind, backend, monkeypatch):
    """The drafter handed zeros for the prefix's rows: the check above sees it."""
    restore = prefix_request.PrefixRequest.restore

    def zeroed_prefix(self):
        length = restore(self)
        self._features = [rows * 0 for rows in self._features]
        self._final = [rows * 0 for rows in self._final]
        return length

    monkeypatch.setattr(prefix_request.PrefixRequest, "restore", zeroed_prefix)
    resumed, cold, worst = resumed_and_cold(pairs, kind, backend)
    assert worst > 1e-2
    assert resumed.token_ids == cold.token_ids  # lossless all the same


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_turn_after_tree_cycles_resumes_the_rows_of_their_paths(pairs, backend):
    """A request verifying trees stores its state when it ends, with the captured rows of each
    tree's accepted path (the ones its caches kept); the next turn (its prompt, answer and more)
    resumes it, and its drafter starts from the rows a cold prefill gives."""
    target, drafter, prompt = pairs["dflash2"]
    config = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
              "drafter": drafter, "verifier": {"kind": "tree", "options": {"budget": 8}}}
    engine = speculant.load_engine(config)
    rows = record_prefill(engine.drafter)
    first = engine.run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True, block_size=8)
    assert first.stats.verifier["trees"] > 0
    turn = prompt + first.token_ids + [3, 4, 5]
    resumed = engine.run(prompt_ids=turn, max_new_tokens=NEW, ignore_eos=True, block_size=8)
    assert resumed.stats.cached_tokens == len(prompt) + len(first.token_ids) - 1
    engine.prefix_store.clear()
    cold = engine.run(prompt_ids=turn, max_new_tokens=NEW, ignore_eos=True, block_size=8)
    got, want = rows[1][0], rows[2][0]
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-4
    assert resumed.token_ids == cold.token_ids
    assert resumed.stats.acceptance_lengths == cold.stats.acceptance_lengths
