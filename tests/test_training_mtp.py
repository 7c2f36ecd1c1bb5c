"""MTP training smoke test: loss goes down, the saved mtp.* folder loads through the mtp
drafter, greedy output equals plain greedy decoding, and the head learned the target."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.training.loop import TrainSettings  # noqa: E402
from training_helpers import TEXTS, lossless_acceptance  # noqa: E402


@pytest.fixture(scope="module")
def target_and_stream(tmp_path_factory):
    from transformers import AutoTokenizer

    from speculant.training.target import TargetShape, encode_corpus, train_target
    from speculant.training.tokenizer import train_tokenizer

    torch.set_num_threads(1)
    tok = tmp_path_factory.mktemp("tok")
    train_tokenizer(TEXTS, tok, vocab_size=300)
    stream = encode_corpus(AutoTokenizer.from_pretrained(str(tok)), TEXTS)
    shape = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=128, max_position_embeddings=256)
    # long enough that its greedy continuations are code, not one repeated token
    settings = TrainSettings(steps=200, lr=3e-3, bf16=False, checkpoint_every=200, warmup_ratio=0.1)
    return train_target(tok, stream, tmp_path_factory.mktemp("target"), shape, settings, batch=4, seq_len=48), stream


@pytest.fixture(scope="module")
def trained_target(target_and_stream):
    return target_and_stream[0]


def train_and_record(target_dir, sequences, out, steps, seed=0):
    from speculant.training import mtp as mtp_mod

    history: list[float] = []
    original = mtp_mod.train
    mtp_mod.train = lambda *a, **k: history.extend(original(*a, **k)) or history
    try:
        settings = TrainSettings(steps=steps, lr=3e-2, bf16=False, checkpoint_every=steps, warmup_ratio=0.1, seed=seed)
        folder = mtp_mod.train_mtp(target_dir, sequences, 8, out, settings=settings, batch=4)
    finally:
        mtp_mod.train = original
    return folder, history


@pytest.fixture(scope="module")
def sequences(target_and_stream):
    from speculant.training.dflash import generate_sequences
    from speculant.training.features import load_frozen_target

    target, stream = target_and_stream
    starts = np.random.default_rng(0).integers(0, len(stream) - 8, size=24)
    prompts = np.stack([stream[s : s + 8] for s in starts]).astype(np.int32)
    sequences = generate_sequences(load_frozen_target(target), prompts, 40)
    # x_{t+2} mostly differs from x_{t+1}: a head trained one step short could not pass
    assert np.mean(sequences[:, 9:] != sequences[:, 8:-1]) > 0.5
    return sequences


@pytest.fixture(scope="module")
def trained_mtp(trained_target, sequences, tmp_path_factory):
    torch.set_num_threads(1)
    return train_and_record(trained_target, sequences, tmp_path_factory.mktemp("mtp") / "mtp", steps=200)


def assert_training_forward_equals_drafter(target_dir, folder, ids):
    """The whole-sequence causal training forward and the drafter's cached one-row-at-a-time
    inference over the saved folder give the same logits (no train/inference drift)."""
    from speculant.core.types import Capture
    from speculant.core.validator import read_target_info
    from speculant.drafters.mtp.config import MTPOptions
    from speculant.drafters.mtp.parse import parse_mtp
    from speculant.drafters.mtp.torch import load_torch_network
    from speculant.training.features import capture_batch, load_frozen_target
    from speculant.training.mtp import mtp_logits

    target = load_frozen_target(target_dir)
    cfg, problems = parse_mtp(folder, read_target_info(target_dir), MTPOptions(), separate=True)
    assert cfg is not None and not [p for p in problems if p.severity == "error"], problems
    assert cfg.norm_offset == 1.0 and cfg.hidden_tap == "post_norm"
    net = load_torch_network(cfg, target.backend, target)
    ids = torch.as_tensor(ids, dtype=torch.long)
    _, final = capture_batch(target, ids[None], Capture(final_hidden=cfg.hidden_tap))
    with torch.no_grad():
        trained = mtp_logits(net.model, target, final[0], ids)
    rows = []
    for p in range(ids.shape[0] - 1):
        _, post = net.run(0, final[0, p : p + 1], ids[p + 1 : p + 2], [p])
        rows.append(net.logits(post))
    torch.testing.assert_close(torch.cat(rows), trained, atol=1e-4, rtol=1e-4)


def test_training_forward_equals_the_loaded_drafter_step_by_step(trained_target, sequences, trained_mtp):
    folder, _ = trained_mtp
    assert_training_forward_equals_drafter(trained_target, folder, sequences[3].astype(np.int64))


def test_mtp_training_learns_and_is_lossless(trained_target, sequences, trained_mtp):
    folder, history = trained_mtp
    assert np.mean(history[-10:]) < 0.5 * np.mean(history[:5])

    config = json.loads((folder / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and "architectures" not in config
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.mlp.down_proj.weight"} <= names
    assert all(n.startswith("mtp.") for n in names)

    assert lossless_acceptance(trained_target, "mtp", folder, sequences) > 1.2  # it learned x_{t+2} (an untrained head gets ~1.0)


def test_cli_trains_resumably(trained_target, tmp_path):
    """``speculant train mtp``: a run stopped at step 2 and resumed ends with the weights of an
    uninterrupted run, and the folder loads as an mtp drafter."""
    from safetensors.torch import load_file

    from speculant.cli import main

    torch.set_num_threads(1)

    def run(out, *extra):
        argv = ["train", "mtp", "--target", str(trained_target), "--out", str(out), "--sequences", "4", "--prompt-len", "8",
                "--response-len", "16", "--steps", "4", "--batch", "2", "--fp32", "--checkpoint-every", "4", "--lr", "1e-2"]
        assert main(argv + list(extra)) == 0

    run(tmp_path / "full")
    run(tmp_path / "resumed", "--stop-at", "2")
    assert json.loads((tmp_path / "resumed" / "checkpoint" / "state.json").read_text())["step"] == 2
    run(tmp_path / "resumed")
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-5, msg=name)
    engine = speculant.load_engine({"target": {"path": str(trained_target)},
                                           "drafter": {"kind": "mtp", "path": str(tmp_path / "full")}})
    assert engine.run(prompt_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True).stats.new_tokens == 6


def test_two_process_data_parallel_mtp(trained_target, sequences, tmp_path):
    """Two CPU processes (torchrun; gloo): gradients are synchronised, so both ranks end with
    the same weights, and only the main process writes the folder."""
    np.save(tmp_path / "sequences.npy", sequences[:8])
    script = tmp_path / "run.py"
    script.write_text(
        "import os, sys, numpy as np, torch\n"
        "torch.set_num_threads(1)\n"
        "from speculant.training import loop, mtp\n"
        "from speculant.training.loop import TrainSettings\n"
        "original = loop.train\n"
        "def train(model, *a, **k):\n"
        "    history = original(model, *a, **k)\n"
        "    total = float(sum(p.double().sum() for p in model.parameters()))\n"
        "    open(sys.argv[3] + f\".rank{os.environ['RANK']}\", 'w').write(repr(total))\n"
        "    return history\n"
        "mtp.train = train\n"
        "sequences = np.load(sys.argv[2])\n"
        "mtp.train_mtp(sys.argv[1], sequences, 8, sys.argv[3],\n"
        "              settings=TrainSettings(steps=3, lr=1e-2, bf16=False, checkpoint_every=3), batch=2)\n"
    )
    from two_processes import run_two_processes

    for rank in (0, 1):
        (tmp_path / f"out.rank{rank}").unlink(missing_ok=True)
    proc = run_two_processes([script, trained_target, tmp_path / "sequences.npy", tmp_path / "out"], clean=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each rank writes its own file: rank 0's progress bar shares stdout with rank 1
    sums = [(tmp_path / f"out.rank{rank}").read_text() for rank in (0, 1)]
    assert sums[0] == sums[1]
    assert json.loads((tmp_path / "out" / "checkpoint" / "state.json").read_text())["step"] == 3
    speculant.load_engine({"target": {"path": str(trained_target)},
                                  "drafter": {"kind": "mtp", "path": str(tmp_path / "out")}})


def test_mtp_trains_on_a_composite_qwen3_5_target(tmp_path):
    """A Qwen3.5 target keeps its language model's keys under ``text_config`` (and gates its
    attention output): the head is shaped from them, the folder declares its layer count where
    the published composite does, and it loads as a lossless drafter that computes what training did."""
    from speculant.testing.tiny_mtp_families import build_family_target
    from speculant.training.dflash import generate_sequences
    from speculant.training.features import load_frozen_target

    torch.set_num_threads(1)
    target_dir = build_family_target(tmp_path / "target", "qwen3_5", hybrid=True)
    prompts = np.random.default_rng(0).integers(3, 200, size=(8, 8)).astype(np.int32)
    sequences = generate_sequences(load_frozen_target(target_dir), prompts, 16)
    folder, history = train_and_record(target_dir, sequences, tmp_path / "mtp", steps=6)
    assert len(history) == 6 and all(np.isfinite(history))

    config = json.loads((folder / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and "architectures" not in config
    assert_training_forward_equals_drafter(target_dir, folder, sequences[0].astype(np.int64))
    lossless_acceptance(target_dir, "mtp", folder, sequences, rows=2)
