"""The shipped DFlash draft loads in the reference package ``dflash`` as it loads in speculant,
and the reference loop produces the same tokens and acceptance lengths on the shipped pair."""

from __future__ import annotations

import pytest

import speculant
from speculant import embedded

harness = pytest.importorskip("reference.harness")
pytestmark = [pytest.mark.reference,
              pytest.mark.skipif(not embedded.available(), reason="the shipped pair is not in this checkout")]


def test_reference_loads_the_shipped_dflash_draft_with_every_key(reference_venv):
    info = harness.reference_load_info(embedded.PAIR_DIR / "dflash")
    loading = info["torch"]
    assert not loading["missing_keys"] and not loading["unexpected_keys"] and not loading["mismatched_keys"]


def long_prompt() -> list[int]:
    """A held-out 400-token window: longer than the block drafters' sliding window (256)."""
    from speculant.training.command import corpus_prompts

    return corpus_prompts(embedded.PAIR_DIR / "target", 1, 400, seed=1234, held_out=True)[0].tolist()


@pytest.mark.parametrize("prompt_kind", ["short", "past_the_window"])
def test_reference_loop_matches_speculant_on_the_shipped_pair(reference_venv, prompt_kind):
    config = embedded.engine_config("dflash", backend="torch", lookup=False)  # the reference has no prompt lookup
    config["backend"].update({"dtype": "float32", "device": "cpu"})
    config["verifier"] = {"kind": "greedy"}  # a full block every cycle, as the reference loop does
    engine = speculant.load_engine(config)
    prompt = (engine.tokenizer.encode("import os\n\n\ndef main(argv):\n", add_special_tokens=False)
              if prompt_kind == "short" else long_prompt())
    ref = harness.run_reference("torch", embedded.PAIR_DIR / "target", embedded.PAIR_DIR / "dflash", prompt, 48, 8)
    ours = engine.run(prompt_ids=prompt, max_new_tokens=48, ignore_eos=True)
    assert ours.token_ids == ref["tokens"]
    assert ours.stats.acceptance_lengths == ref["acceptance_lengths"]
