"""The model pair shipped in speculant/embedded/pair: intact, lossless, and drafting well enough.

The acceptance-length floor (2.0) is a regression guard far below the benchmark
(benchmarks/embedded_pair.py); losslessness is checked in float32, where a block forward and a
one-token forward agree exactly.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

import speculant
from speculant import embedded

pytestmark = pytest.mark.skipif(not embedded.available(), reason="the shipped pair is not in this checkout")

PROMPT = "def parse_args(argv):"
CODE_PROMPT = "import os\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
# a fixed prompt on which the shipped block drafters accept long runs (PyTorch, float32, 96 tokens)
TAU_PROMPT = "__all__ = ["


def engine(drafter, backend="torch", dtype="float32", verifier=None, lookup=False, **drafter_fields):
    config = embedded.engine_config(drafter, backend=backend, lookup=lookup)
    config["backend"].update({"dtype": dtype, "device": "cpu"})
    if verifier is not None:  # the shipped default is adaptive, which decodes plainly where drafts do not pay
        config["verifier"] = {"kind": verifier}
    config["drafter"].update(drafter_fields)
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def plain_runs():
    plain = engine(None)
    return {prompt: plain.run(prompt, max_new_tokens=96, ignore_eos=True) for prompt in (PROMPT, CODE_PROMPT, TAU_PROMPT)}


def test_manifest_matches_the_files_and_the_size_limit():
    manifest = embedded.manifest()
    files = {p.relative_to(embedded.PAIR_DIR).as_posix(): p for p in embedded.PAIR_DIR.rglob("*") if p.is_file()}
    assert set(files) == set(manifest["files"]) | {"MANIFEST.json"}
    for name, record in manifest["files"].items():
        assert files[name].stat().st_size == record["bytes"], name
        assert hashlib.sha256(files[name].read_bytes()).hexdigest() == record["sha256"], name
    assert sum(p.stat().st_size for p in files.values()) <= 40 * 1024 * 1024
    corpus = manifest["corpus"]
    assert corpus["train_tokens"] > 1_000_000 and corpus["held_out_files"] > 0
    assert set(manifest["training"]) == {"target", "dflash", "dflash2", "mtp"}
    listed = json.loads((embedded.PAIR_DIR / "corpus.json").read_text())
    assert len(listed["train_files"]) == corpus["train_files"]


@pytest.mark.parametrize("drafter", ["dflash", "dflash2", "mtp"])
def test_shipped_drafters_are_lossless_and_accept_drafts(drafter, plain_runs):
    spec = engine(drafter)
    for prompt, plain in plain_runs.items():
        result = spec.run(prompt, max_new_tokens=96, ignore_eos=True)
        assert result.token_ids == plain.token_ids, (drafter, prompt)
        assert result.stats.new_tokens == 1 + sum(result.stats.acceptance_lengths)
    if drafter != "mtp":  # block 8 drafters; MTP (one head) drafts at most a couple of tokens
        fixed = engine(drafter, verifier="speculative_sampling")  # every cycle drafts a full block
        assert fixed.run(TAU_PROMPT, max_new_tokens=96, ignore_eos=True).stats.mean_acceptance_length > 2.0


@pytest.mark.parametrize("drafter", ["dflash2", "mtp"])  # weights stored in bfloat16, loaded into float32
def test_shipped_pair_is_lossless_on_mlx(drafter, plain_runs):
    pytest.importorskip("mlx_lm")
    spec = engine(drafter, backend="mlx", verifier="speculative_sampling")
    for prompt in (CODE_PROMPT, TAU_PROMPT):
        result = spec.run(prompt, max_new_tokens=96, ignore_eos=True)
        assert result.token_ids == plain_runs[prompt].token_ids
    assert result.stats.mean_acceptance_length > (2.0 if drafter == "dflash2" else 1.0)


def test_the_default_engine_with_prompt_lookup_is_lossless_and_copies_loops(plain_runs):
    spec, copies = engine("dflash2", verifier="adaptive", lookup=True), 0
    for prompt, plain in plain_runs.items():
        result = spec.run(prompt, max_new_tokens=96, ignore_eos=True)
        assert result.token_ids == plain.token_ids, prompt
        copies += result.stats.lookup_steps
    assert copies > 0


def test_the_default_engine_is_dflash2_on_the_shipped_pair():
    config = embedded.engine_config()
    assert config["drafter"]["kind"] == "dflash2"
    assert config["verifier"]["kind"] == "adaptive"  # the block drafters pay only on predictable code
    assert config["drafter"]["path"] == str(embedded.PAIR_DIR / "dflash2")
    assert config["drafter"]["lookup"]["enabled"] is True  # copies where the target loops over its own text
    with pytest.raises(ValueError, match="dflash2, dflash, mtp"):
        embedded.engine_config("medusa")


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "speculant", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_generate_without_a_config_streams_code_from_the_shipped_pair():
    proc = cli("generate", PROMPT, "--max-new-tokens", "40", "--backend", "torch", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    assert stats["new_tokens"] <= 40 and stats["verify_steps"] >= 1
    assert stats["lookup_steps"] <= stats["verify_steps"]


def test_generate_no_lookup_turns_the_copies_off():
    proc = cli("generate", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = [1, 2, 3]\n", "--max-new-tokens", "40",
               "--backend", "torch", "--json", "--no-lookup")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stderr.strip().splitlines()[-1])["lookup_steps"] == 0


def test_generate_compare_reports_the_speed_up_and_identical_output():
    proc = cli("generate", CODE_PROMPT, "--max-new-tokens", "48", "--backend", "torch", "--dtype", "float32",
               "--compare", "--drafter", "dflash")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "speed-up" in proc.stderr
    assert "identical output: all" in proc.stderr


def test_load_pair_gives_python_the_engine_the_cli_runs():
    from speculant.core.config import EngineConfig
    from speculant.core.errors import SettingError
    from speculant.pairs import PullError

    engine = speculant.load_pair("tiny", backend="torch")
    assert engine.config == EngineConfig.load(embedded.engine_config(embedded.DEFAULT_DRAFTER, backend="torch"))
    assert speculant.load_pair("tiny", drafter="none", backend="torch").drafter is None
    with pytest.raises(SettingError, match="messages: the target's tokenizer has no chat template"):
        engine.chat_ids("hi")  # the code model has none: prompts are text there
    with pytest.raises(ValueError, match="eagle"):
        speculant.load_pair("tiny", drafter="eagle")
    with pytest.raises(PullError, match="unknown pair 'llama70b'"):
        speculant.load_pair("llama70b")


def test_copies_of_a_prompt_sampled_with_one_seed_are_other_samples():
    """``run_many`` with a seed: each request draws from its own child of it (the first from the
    seed itself, as ``run`` does), so n copies of a prompt are n samples, not one repeated."""
    chain = engine("dflash2", verifier="speculative_sampling")
    settings = dict(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    copies = chain.run_many([PROMPT] * 4, **settings)
    assert len({tuple(r.token_ids) for r in copies}) == 4
    assert chain.run_many([PROMPT], **settings)[0].token_ids == chain.run(PROMPT, **settings).token_ids


def test_generate_without_a_config_refuses_a_foreign_draft():
    proc = cli("generate", PROMPT, "--draft", "/nonexistent")
    assert proc.returncode == 2
    assert "--draft needs --target or --config" in proc.stderr


def test_train_evaluate_prints_the_held_out_mean_acceptance_length(capsys):
    """``speculant train evaluate``, the final evaluation of a trained draft: mean acceptance
    length over held-out corpus prompts, as JSON, equal to the engine's own figure per prompt."""
    from speculant.cli import main
    from speculant.training.command import corpus_prompts

    target, draft = embedded.PAIR_DIR / "target", embedded.PAIR_DIR / "dflash"
    assert main(["train", "evaluate", "--target", str(target), "--draft", str(draft), "--prompts", "2",
                 "--max-new-tokens", "24"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 2 and len(result["per_prompt"]) == 2
    assert result["mean_acceptance_length"] == pytest.approx(sum(result["per_prompt"]) / 2)
    check = speculant.load_engine({"target": {"path": str(target)}, "drafter": {"kind": "dflash", "path": str(draft)}})
    first = corpus_prompts(target, 2, 64, seed=1234, held_out=True)[0]
    stats = check.run(prompt_ids=first.tolist(), max_new_tokens=24, ignore_eos=True).stats
    assert result["per_prompt"][0] == pytest.approx(stats.mean_acceptance_length)
    assert 1.0 < result["mean_acceptance_length"] <= 8.0


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_block_drafters_keep_drafting_well_past_the_contexts_they_were_trained_on(drafter, tmp_path):
    """Trained on contexts of at most 320 tokens, the block drafters read only the last 255 rows
    (their configs' sliding window). On held-out 512-token prompts that stays lossless and accepts
    clearly more than the same weights reading the whole context."""
    import shutil

    from speculant.training.command import corpus_prompts

    shipped = json.loads((embedded.PAIR_DIR / drafter / "config.json").read_text())
    assert shipped["layer_types"] == ["sliding_attention"] * 2 and shipped["sliding_window"] == 256
    assert shipped["is_causal"] is False
    unbounded = tmp_path / drafter
    shutil.copytree(embedded.PAIR_DIR / drafter, unbounded)
    (unbounded / "config.json").write_text(json.dumps({**shipped, "sliding_window": 4096}))
    prompts = [p.tolist() for p in corpus_prompts(embedded.PAIR_DIR / "target", 3, 512, seed=1234, held_out=True)]
    plain, windowed = engine(None), engine(drafter, verifier="speculative_sampling")
    whole = engine(drafter, verifier="speculative_sampling", path=str(unbounded))
    taus = {"windowed": [], "whole": []}
    for prompt in prompts:
        expected = plain.run(prompt_ids=prompt, max_new_tokens=64, ignore_eos=True).token_ids
        for name, spec in (("windowed", windowed), ("whole", whole)):
            result = spec.run(prompt_ids=prompt, max_new_tokens=64, ignore_eos=True)
            assert result.token_ids == expected, (drafter, name)
            taus[name].append(result.stats.mean_acceptance_length)
    assert sum(taus["windowed"]) > sum(taus["whole"]) + 0.9, taus  # 0.3 per prompt
