"""Training smoke tests: loss goes down, files load through the project's loaders, lossless output."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.training.loop import TrainSettings  # noqa: E402
from training_helpers import TEXTS, lossless_acceptance  # noqa: E402



def test_progress_shows_loss_throughput_metrics_and_eta():
    from rich.progress import TimeRemainingColumn

    from speculant.training.loop import _Progress

    progress = _Progress("dflash", total=10, start=2, enabled=True)
    try:
        progress.update(3, 1.2345, 512, {"acc1": 0.25})
        task = progress.bar.tasks[0]
        assert task.completed == 3 and task.total == 10
        info = task.fields["info"]
        assert info.startswith("loss 1.2345 ") and "tok/s" in info and info.endswith("acc1 0.250")
        assert any(isinstance(c, TimeRemainingColumn) for c in progress.bar.columns)  # the ETA
    finally:
        progress.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from speculant.training.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, out, vocab_size=300)
    return out


def test_tokenizer_has_eos_and_mask(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.convert_ids_to_tokens([0, 1]) == ["<|endoftext|>", "<|mask|>"]
    assert tok.eos_token_id == 0 and tok.mask_token_id == 1
    text = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok.encode(text)) == text


def small_target(tokenizer_dir, out, steps=40, stop_at=None):
    from transformers import AutoTokenizer

    from speculant.training.target import TargetShape, encode_corpus, train_target

    stream = encode_corpus(AutoTokenizer.from_pretrained(str(tokenizer_dir)), TEXTS)
    shape = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, max_position_embeddings=256)
    settings = TrainSettings(steps=steps, lr=3e-3, bf16=False, checkpoint_every=20, warmup_ratio=0.1, stop_at=stop_at)
    return train_target(tokenizer_dir, stream, out, shape, settings, batch=4, seq_len=48), stream, shape, settings


@pytest.fixture(scope="module")
def trained_target(tokenizer_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield small_target(tokenizer_dir, tmp_path_factory.mktemp("target"))[0]
    torch.set_num_threads(threads)


def test_target_loss_decreases_and_loads(trained_target):
    from transformers import AutoModelForCausalLM

    info = json.loads((trained_target / "training.json").read_text())
    assert info["train_tokens_seen"] > 0
    AutoModelForCausalLM.from_pretrained(str(trained_target))  # transformers loads it unchanged
    engine = speculant.load_engine({"target": {"path": str(trained_target)}})
    text = engine.run("def add(", max_new_tokens=8, ignore_eos=True).text
    assert isinstance(text, str) and engine.last_stats.new_tokens == 8


def test_loss_history_goes_down(tokenizer_dir, tmp_path):
    from speculant.training import loop

    history = []
    original = loop.train

    def recording_train(*args, **kwargs):
        history.extend(original(*args, **kwargs))
        return history

    loop_train = loop.train
    try:
        import speculant.training.target as target_mod

        target_mod.train = recording_train
        small_target(tokenizer_dir, tmp_path / "t", steps=40)
    finally:
        target_mod.train = loop_train
    assert np.mean(history[-5:]) < 0.8 * np.mean(history[:5])


def test_resume_gives_the_same_weights(tokenizer_dir, tmp_path):
    from safetensors.torch import load_file

    full, *_ = small_target(tokenizer_dir, tmp_path / "full", steps=30)
    # a run that stops at step 13 (checkpointed there), then resumes to 30
    small_target(tokenizer_dir, tmp_path / "resumed", steps=30, stop_at=13)
    resumed, *_ = small_target(tokenizer_dir, tmp_path / "resumed", steps=30)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_dflash_training_learns_and_is_lossless(trained_target, tmp_path):
    from speculant.training.dflash import DFlashShape, generate_sequences, train_dflash
    from speculant.training.features import load_frozen_target

    target = load_frozen_target(trained_target)
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, 300, size=(24, 8)).astype(np.int32)
    sequences = generate_sequences(target, prompts, 40)
    shape = DFlashShape(num_layers=1, block_size=4, num_features=2, anchors_per_sequence=16)
    settings = TrainSettings(steps=100, lr=1e-2, bf16=False, checkpoint_every=100, warmup_ratio=0.1)
    from speculant.training import dflash as dflash_mod

    history = []
    original = dflash_mod.train
    dflash_mod.train = lambda *a, **k: history.extend(original(*a, **k)) or history
    try:
        draft = train_dflash(trained_target, sequences, 8, tmp_path / "draft", shape, settings, batch=2)
    finally:
        dflash_mod.train = original
    assert np.mean(history[-10:]) < 0.7 * np.mean(history[:5])
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["mask_token_id"] == 1
    assert lossless_acceptance(trained_target, "dflash", draft, sequences) > 1.5  # it learned the target's behaviour (an untrained draft gets ~1.0)


def test_dflash_training_continues_from_a_trained_draft(trained_target, tmp_path):
    """--init-from: a second run (e.g. on more data) starts where the first ended, not from scratch."""
    from speculant.training import dflash as dflash_mod

    target = dflash_mod.load_frozen_target(trained_target)
    prompts = np.random.default_rng(1).integers(2, 300, size=(16, 8)).astype(np.int32)
    sequences = dflash_mod.generate_sequences(target, prompts, 40)
    shape = dflash_mod.DFlashShape(num_layers=1, block_size=4, num_features=2, anchors_per_sequence=16)
    settings = TrainSettings(steps=60, lr=1e-2, bf16=False, checkpoint_every=60, warmup_ratio=0.1)
    histories = []
    original = dflash_mod.train
    dflash_mod.train = lambda *a, **k: histories.append(original(*a, **k)) or histories[-1]
    try:
        first = dflash_mod.train_dflash(trained_target, sequences, 8, tmp_path / "first", shape, settings, batch=2)
        dflash_mod.train_dflash(trained_target, sequences, 8, tmp_path / "fresh", shape, settings, batch=2)
        dflash_mod.train_dflash(trained_target, sequences, 8, tmp_path / "continued", shape, settings, batch=2,
                                init_from=first)
    finally:
        dflash_mod.train = original
    first_loss, fresh_loss, continued_loss = (np.mean(h[:3]) for h in histories)
    assert fresh_loss == pytest.approx(first_loss)  # same seed, same data: the comparison is fair
    assert continued_loss < 0.8 * fresh_loss
    assert continued_loss < 1.2 * np.mean(histories[0][-5:])
    assert json.loads((tmp_path / "continued" / "training.json").read_text())["init_from"] == "first"
    with pytest.raises(ValueError, match="does not match this draft's shape"):
        dflash_mod.train_dflash(trained_target, sequences, 8, tmp_path / "deeper",
                                dflash_mod.DFlashShape(num_layers=2, block_size=4, num_features=2), settings, init_from=first)


def test_two_process_data_parallel_training(tokenizer_dir, tmp_path):
    """Two data-parallel CPU processes (torch.distributed.run) run the same trainer."""
    script = tmp_path / "run.py"
    script.write_text(
        "import sys\n"
        "from tests_training_entry import main\n"
        "main(sys.argv[1], sys.argv[2])\n"
    )
    (tmp_path / "tests_training_entry.py").write_text(
        "from pathlib import Path\n"
        "import torch\n"
        "from transformers import AutoTokenizer\n"
        "from speculant.training.loop import TrainSettings\n"
        "from speculant.training.target import TargetShape, encode_corpus, train_target\n"
        f"TEXTS = {TEXTS[:3]!r} * 20\n"
        "def main(tok, out):\n"
        "    torch.set_num_threads(1)\n"
        "    stream = encode_corpus(AutoTokenizer.from_pretrained(tok), TEXTS)\n"
        "    shape = TargetShape(64, 2, 4, 2, 16, 128, 256)\n"
        "    train_target(tok, stream, Path(out), shape, TrainSettings(steps=6, lr=1e-3, bf16=False, checkpoint_every=3), 2, 32)\n"
        "    import os, torch.distributed as dist\n"
        "    (Path(out) / f'rank{os.environ[\"RANK\"]}-of-{dist.get_world_size()}').touch()\n"
    )
    from two_processes import run_two_processes

    env = {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = run_two_processes([script, tokenizer_dir, tmp_path / "out"], clean=tmp_path / "out", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "model" / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "out").glob("rank*")) == ["rank0-of-2", "rank1-of-2"]
    assert json.loads((tmp_path / "out" / "checkpoint" / "state.json").read_text())["step"] == 6


def test_chosen_target_layer_ids_reach_the_draft_config(trained_target, tmp_path):
    from speculant.cli import build_parser
    from speculant.training.dflash import DFlashShape, new_draft_config

    args = build_parser().parse_args(["train", "dflash", "--target", str(trained_target), "--out", str(tmp_path),
                                      "--target-layer-ids", "0,1"])
    assert args.target_layer_ids == (0, 1)
    from speculant.training.command import _block_shape_flags

    assert _block_shape_flags(args) == {"num_features": 2, "target_layer_ids": (0, 1)}  # the ids set the count
    cfg = new_draft_config(trained_target, tmp_path / "d", DFlashShape(num_features=2, target_layer_ids=(0, 1)))
    assert cfg.target_layer_ids == [0, 1]
    layers = json.loads((trained_target / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ValueError, match=f"0..{layers - 1}"):
        new_draft_config(trained_target, tmp_path / "e", DFlashShape(num_features=2, target_layer_ids=(0, layers)))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "dflash", "--target", "t", "--out", "o", "--target-layer-ids", "1,x"])


def test_a_sliding_window_reaches_the_config_and_training_sees_what_inference_sees(trained_target, tmp_path):
    """--sliding-window: the draft config gets non-causal sliding layers, and the training forward
    attends to exactly the context rows the inference drafter keeps (beyond the window, too)."""
    from speculant.cli import build_parser
    from speculant.core.types import Capture, DraftRequest
    from speculant.training import dflash as dflash_mod
    from speculant.training.command import _block_shape_flags

    args = build_parser().parse_args(["train", "dflash", "--target", str(trained_target), "--out", str(tmp_path),
                                      "--sliding-window", "6"])
    assert _block_shape_flags(args)["sliding_window"] == 6
    target = dflash_mod.load_frozen_target(trained_target)
    prompts = np.random.default_rng(2).integers(2, 300, size=(8, 8)).astype(np.int32)
    sequences = dflash_mod.generate_sequences(target, prompts, 40)
    shape = dflash_mod.DFlashShape(num_layers=2, block_size=4, num_features=2, anchors_per_sequence=8, sliding_window=6)
    settings = TrainSettings(steps=3, lr=1e-2, bf16=False, checkpoint_every=3, warmup_ratio=0.1)
    draft = dflash_mod.train_dflash(trained_target, sequences, 8, tmp_path / "draft", shape, settings, batch=2)
    config = json.loads((draft / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 6
    assert config["is_causal"] is False  # the block stays bidirectional, as without a window

    engine = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                           "target": {"path": str(trained_target)},
                                           "drafter": {"kind": "dflash", "path": str(draft)}})
    drafter, cfg = engine.drafter, engine.drafter.cfg
    tokens = torch.from_numpy(sequences[0].astype(np.int64))
    anchor = 30  # 30 context rows, five times the window
    features, _ = dflash_mod.capture_batch(target, tokens[None], Capture(tuple(cfg.target_layer_ids)))
    with torch.no_grad():
        trained = dflash_mod.draft_forward(drafter.model, target, features[0], tokens, torch.tensor([anchor]), cfg)[0, 1:]
        everything = dflash_mod.draft_forward(drafter.model, target, features[0], tokens, torch.tensor([anchor]),
                                              cfg, run_layer=lambda layer, x, cos, sin, context, mask: layer(
                                                  x, cos, sin, context, dflash_mod.block_mask(torch.tensor([anchor]),
                                                                                          len(tokens), 4)))[0, 1:]
    engine.target.reset()
    out = engine.target.prefill(tokens[:anchor].tolist(), drafter.info.capture)
    drafter.prefill(tokens[:anchor].tolist(), out, int(tokens[anchor]))
    inferred = drafter.hidden(DraftRequest(int(tokens[anchor]), anchor, 3))
    assert torch.allclose(trained, inferred, atol=1e-5)
    assert not torch.allclose(everything, inferred, atol=1e-3)  # the window matters here: the check can fail


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_drafts_train_for_a_composite_hybrid_target(tmp_path, kind):
    """Qwen3.5 checkpoints keep the text model's config under text_config: the trainers read it
    there (they raised KeyError on num_hidden_layers), and the draft they write decodes losslessly."""
    from speculant.testing.tiny_families import build_tiny_family
    from speculant.training.dflash import DFlashShape, generate_sequences, train_dflash
    from speculant.training.dflash2 import DFlash2Shape, train_dflash2
    from speculant.training.features import load_frozen_target

    target = build_tiny_family(tmp_path / "target", "qwen3_5")
    prompts = np.random.default_rng(0).integers(2, 300, size=(4, 8)).astype(np.int32)
    sequences = generate_sequences(load_frozen_target(target), prompts, 16)
    settings = TrainSettings(steps=3, lr=1e-2, bf16=False, checkpoint_every=100, warmup_ratio=0.1)
    if kind == "dflash":
        shape = DFlashShape(num_layers=1, block_size=4, num_features=2, anchors_per_sequence=4)
        draft = train_dflash(target, sequences, 8, tmp_path / "draft", shape, settings, batch=2)
    else:
        shape = DFlash2Shape(num_layers=1, block_size=4, num_features=2, anchors_per_sequence=4,
                             selector_rank=8, selector_top_k=4, sliding_window=64)
        draft = train_dflash2(target, sequences, 8, tmp_path / "draft", shape, settings, batch=2)
    config = json.loads((draft / "config.json").read_text())
    assert config["num_target_layers"] == 4 and config["hidden_size"] == 64
    spec = speculant.load_engine({"target": {"path": str(target)}, "drafter": {"kind": kind, "path": str(draft)}})
    plain = spec.without_drafter()
    prompt = sequences[0, :8].tolist()
    result = spec.run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True)
    assert result.token_ids == plain.run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True).token_ids


def test_steps_within_a_time_budget():
    from speculant.training.loop import steps_within

    assert steps_within(TrainSettings(steps=1000, time_budget=10.0), 0.09) == 100  # 90 % of the budget
    assert steps_within(TrainSettings(steps=50, time_budget=10.0), 0.01) == 50  # never more than asked
    assert steps_within(TrainSettings(steps=50, time_budget=0.01), 5.0) == 1


def test_a_time_budget_lowers_the_steps_and_a_resume_keeps_them(tmp_path):
    import time as clock

    from speculant.training.loop import train

    def run(stop_at=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        settings = TrainSettings(steps=1000, lr=1e-2, bf16=False, checkpoint_every=5, time_budget=1.0, stop_at=stop_at)

        def loss_fn(m, batch):
            clock.sleep(0.05)  # each pass takes at least 50 ms, so at most 18 steps fit in 0.9 s
            return ((m(batch) - 1.0) ** 2).mean(), 4, {}

        history = train(model, lambda step, rank: torch.ones(2, 4) * (step % 3), loss_fn, settings, tmp_path / "ck")
        return settings, history

    first, history = run(stop_at=3)
    assert 1 <= first.steps <= 18 and len(history) == min(3, first.steps)
    state = json.loads((tmp_path / "ck" / "state.json").read_text())
    assert state["steps"] == first.steps
    resumed, history = run()  # the chosen steps come back from the checkpoint, not from a new timing
    assert resumed.steps == first.steps and len(history) == first.steps - min(3, first.steps)
