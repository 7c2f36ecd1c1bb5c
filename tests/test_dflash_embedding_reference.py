"""A Gemma target's DFlash draft, on both backends, against the official reference ``dflash`` 0.1.0.

Gemma's embedding module multiplies the table's rows by sqrt(hidden_size). The reference feeds a
DFlash draft the bare rows times the draft's own ``input_embedding_scale`` (``dflash.model``'s
``_raw_input_embeddings`` reads the table past the module; ``dflash.model_mlx`` multiplies only by
an ``embed_scale`` attribute, which mlx-lm's Gemma 3 does not have), so a published Gemma draft
that wants Gemma's scale says so in that key. On identical weights, with that key set, speculant
must propose what the reference proposes in every cycle, on PyTorch and on MLX, and the trainer's
forward must give the reference's draft logits; feeding the target's scaled rows (what
``target.embed`` gives an MTP head) changes both.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

import speculant
from engine_recording import run_recording_proposals

harness = pytest.importorskip("reference.harness")
pytestmark = pytest.mark.reference

PROMPTS = {"short": [5, 6, 7], "long": list(range(20, 52))}
BLOCK, NEW_TOKENS = 4, 24
SCALE = 8.0  # sqrt(hidden_size 64): what a draft trained on Gemma's scaled rows declares


def has_mlx() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("mlx", "mlx_lm"))


BACKENDS = ["torch", pytest.param("mlx", marks=[pytest.mark.mlx, pytest.mark.skipif(not has_mlx(), reason="needs mlx")])]


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny import build_tiny_dflash
    from speculant.testing.tiny_families import build_tiny_family

    root = tmp_path_factory.mktemp("gemma_dflash")
    target = build_tiny_family(root / "target", "gemma3_text")
    draft = build_tiny_dflash(root / "draft", target, seed=7, block_size=BLOCK)
    config = json.loads((draft / "config.json").read_text())
    config["dflash_config"]["input_embedding_scale"] = SCALE
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    return target, draft


@pytest.fixture(scope="module")
def reference_runs(reference_venv, gemma_pair):
    target, draft = gemma_pair
    jobs = [dict(backend="torch", target_dir=target, draft_dir=draft, prompt_ids=prompt, max_new_tokens=NEW_TOKENS,
                 block_size=BLOCK, capture_logits=True) for prompt in PROMPTS.values()]
    return dict(zip(PROMPTS, harness.run_reference_batch(jobs)))


def full_block_cycles(ours, proposals, ref) -> list[int]:
    """Cycles up to the first where speculant drafts fewer tokens than the reference (near the
    end it verifies one row more than can be emitted; the block is bidirectional, so a narrower
    one proposes differently)."""
    produced, cycles = 1, []
    for i, length in enumerate(ours.stats.acceptance_lengths):
        if min(BLOCK - 1, NEW_TOKENS - produced - 1) != len(ref["proposals"][i]):
            break
        cycles.append(i)
        produced += length
    return cycles


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_gemma_draft_proposes_what_the_reference_does(gemma_pair, reference_runs, backend, prompt):
    target, draft = gemma_pair
    engine = speculant.load_engine({"backend": {"kind": backend, "device": "cpu", "dtype": "float32"},
                                    "target": {"path": str(target)},
                                    "drafter": {"kind": "dflash", "path": str(draft), "lookup": False}})
    ref = reference_runs[prompt]
    ours, proposals = run_recording_proposals(engine, prompt_ids=PROMPTS[prompt], max_new_tokens=NEW_TOKENS,
                                              block_size=BLOCK, ignore_eos=True)
    assert ours.token_ids == ref["tokens"]
    cycles = full_block_cycles(ours, proposals, ref)
    assert len(cycles) >= len(ours.stats.acceptance_lengths) - BLOCK  # only the tail can differ
    assert [proposals[i] for i in cycles] == [ref["proposals"][i] for i in cycles]
    assert [ours.stats.acceptance_lengths[i] for i in cycles] == [ref["acceptance_lengths"][i] for i in cycles]


def test_the_trainers_forward_gives_the_reference_draft_logits(gemma_pair, reference_runs):
    """The first cycle of the long prompt, as ``train dflash`` computes it: the block after the
    prompt, anchored at the target's first token, over the prompt's captured features."""
    import torch

    from speculant.core.types import Capture
    from speculant.training import dflash as dflash_mod

    target_dir, draft = gemma_pair
    ref = reference_runs["long"]
    engine = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                    "target": {"path": str(target_dir)},
                                    "drafter": {"kind": "dflash", "path": str(draft)}})
    cfg = engine.drafter.cfg
    target = dflash_mod.load_frozen_target(target_dir)
    tokens = torch.tensor(PROMPTS["long"] + ref["tokens"][:1])
    anchor = torch.tensor([len(PROMPTS["long"])])
    features, _ = dflash_mod.capture_batch(target, tokens[None], Capture(tuple(cfg.target_layer_ids)))
    with torch.no_grad():
        hidden = dflash_mod.draft_forward(engine.drafter.model, target, features[0], tokens, anchor, cfg)[0, 1:]
        logits = target.lm_head(hidden, raw=True)
    torch.testing.assert_close(logits, torch.tensor(ref["draft_logits"][0]), atol=1e-4, rtol=1e-4)
