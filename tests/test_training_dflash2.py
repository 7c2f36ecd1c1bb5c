"""DFlash2 training: identity initialisation equals DFlash, blocks never see each other through
the convolutions, the loss decreases, candidate recall is reported, the saved draft loads in the
published layout and decodes losslessly with a real acceptance length."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import speculant  # noqa: E402
from speculant.training.loop import TrainSettings  # noqa: E402
from training_helpers import lossless_acceptance  # noqa: E402
from test_training_mtp import sequences, target_and_stream, trained_target  # noqa: E402,F401  (module fixtures)

SHAPE = dict(num_layers=1, block_size=4, num_features=2, anchors_per_sequence=16, conv_group_size=16,
             selector_rank=8, selector_top_k=4)


def fresh_draft(trained_target, folder, seed=0):
    from speculant.training.dflash2 import DFlash2Shape, init_dflash2, new_dflash2_config, save_dflash2

    cfg = new_dflash2_config(trained_target, folder, DFlash2Shape(**SHAPE))
    model = init_dflash2(cfg, seed)
    save_dflash2(model, folder)
    return cfg, model


def test_untrained_dflash2_proposes_what_dflash_does(trained_target, sequences, tmp_path):
    from safetensors.torch import load_file, save_file

    from speculant.drafters.dflash.config import published_config

    cfg, _ = fresh_draft(trained_target, tmp_path / "v2")
    # the same v1 tensors as a DFlash draft
    tcfg = json.loads((trained_target / "config.json").read_text())
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "config.json").write_text(json.dumps(published_config(tcfg, cfg.mask_token_id, list(cfg.target_layer_ids),
                                                                cfg.num_hidden_layers, cfg.block_size)))
    state = load_file(str(tmp_path / "v2" / "model.safetensors"))
    save_file({k: v for k, v in state.items() if "conv" not in k and not k.startswith("candidate_selector")},
              str(v1 / "model.safetensors"), metadata={"format": "pt"})
    runs = {}
    for kind, folder in (("dflash", v1), ("dflash2", tmp_path / "v2")):
        engine = speculant.load_engine({"target": {"path": str(trained_target)},
                                               "drafter": {"kind": kind, "path": str(folder)}})
        runs[kind] = [engine.run(prompt_ids=sequences[r, :8].tolist(), max_new_tokens=24, ignore_eos=True).stats.acceptance_lengths
                      for r in range(3)]
    assert runs["dflash2"] == runs["dflash"]


def test_identity_init_is_exactly_dflash(trained_target, sequences, tmp_path):
    """Fresh DFlash2 layers compute the DFlash layers' hidden states, and the selector's scores
    are the unary logits whatever the predecessor."""
    from speculant.core.types import Capture
    from speculant.drafters.dflash.torch import DFlashModel
    from speculant.training.dflash import draft_forward
    from speculant.training.dflash2 import blockwise
    from speculant.training.features import capture_batch, load_frozen_target

    cfg, model = fresh_draft(trained_target, tmp_path / "v2")
    v1 = DFlashModel(cfg)
    v1.load_state_dict({k: v for k, v in model.state_dict().items() if k in v1.state_dict()}, strict=True)
    target = load_frozen_target(trained_target)
    ids = torch.from_numpy(sequences[1].astype(np.int64))
    features, _ = capture_batch(target, ids[None], Capture(tuple(cfg.target_layer_ids)))
    anchors = torch.tensor([7, 15, 25])
    with torch.no_grad():
        two = draft_forward(model, target, features[0], ids, anchors, cfg, run_layer=blockwise(cfg.block_size))
        one = draft_forward(v1, target, features[0], ids, anchors, cfg)
        torch.testing.assert_close(two, one, atol=1e-6, rtol=1e-6)
        hidden = two[0, 1:]
        logits = target._head(hidden).float()
        scores, _ = model.candidate_selector.score_table(hidden, logits, int(ids[7]))
    unary = torch.topk(logits, cfg.selector_top_k, dim=-1).values
    K = cfg.selector_top_k
    torch.testing.assert_close(scores[:K], unary[0], atol=0, rtol=0)
    torch.testing.assert_close(scores[K:].view(-1, K, K), unary[1:, None, :].expand(-1, K, K), atol=0, rtol=0)


def test_blocks_run_separately(trained_target, sequences, tmp_path):
    """Several anchors at once give what each anchor gives alone (no leakage across blocks
    through the convolutions), also with non-identity convolutions."""
    from speculant.core.types import Capture
    from speculant.training.dflash import draft_forward
    from speculant.training.dflash2 import blockwise
    from speculant.training.features import capture_batch, load_frozen_target

    cfg, model = fresh_draft(trained_target, tmp_path / "v2")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    target = load_frozen_target(trained_target)
    ids = torch.from_numpy(sequences[2].astype(np.int64))
    features, _ = capture_batch(target, ids[None], Capture(tuple(cfg.target_layer_ids)))
    anchors = torch.tensor([7, 8, 11, 20, 30])
    with torch.no_grad():
        together = draft_forward(model, target, features[0], ids, anchors, cfg, run_layer=blockwise(cfg.block_size))
        alone = torch.cat([draft_forward(model, target, features[0], ids, anchors[i : i + 1], cfg) for i in range(len(anchors))])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_dflash2_training_learns_and_is_lossless(trained_target, sequences, tmp_path):
    from safetensors import safe_open

    from speculant.training import dflash2 as mod

    torch.set_num_threads(1)
    history: list[float] = []
    metrics: list[dict] = []
    original_train, original_loss = mod.train, mod.dflash2_loss
    mod.train = lambda *a, **k: history.extend(original_train(*a, **k)) or history

    def recording_loss(*a, **k):
        loss, m = original_loss(*a, **k)
        metrics.append(m)
        return loss, m

    mod.dflash2_loss = recording_loss
    try:
        settings = TrainSettings(steps=100, lr=1e-2, bf16=False, checkpoint_every=100, warmup_ratio=0.1)
        draft = mod.train_dflash2(trained_target, sequences, 8, tmp_path / "draft", mod.DFlash2Shape(**SHAPE), settings, batch=2)
    finally:
        mod.train, mod.dflash2_loss = original_train, original_loss
    assert np.mean(history[-10:]) < 0.5 * np.mean(history[:5])
    recall = [m["candidate_recall"] for m in metrics]
    assert 0.0 <= min(recall) and np.mean(recall[-20:]) > 0.5
    assert np.mean([m["selector"] for m in metrics[-20:]]) < np.mean([m["selector"] for m in metrics[:10]])

    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"]["block_size"] == 4 and config["dflash_config"]["selector_top_k"] == 4
    with safe_open(str(draft / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        successor = fh.get_tensor("candidate_selector.successor_codebook")
    assert "candidate_selector.predecessor_codebook" in names and "layers.0.attention_conv.base_kernel" in names
    assert successor.abs().max() > 0  # the selector trained away from its identity start

    assert lossless_acceptance(trained_target, "dflash2", draft, sequences) > 1.5


def test_cli_dflash2(trained_target, tmp_path):
    from speculant.cli import main

    torch.set_num_threads(1)
    out = tmp_path / "cli"
    argv = ["train", "dflash2", "--target", str(trained_target), "--out", str(out), "--sequences", "4", "--prompt-len", "8",
            "--response-len", "16", "--block-size", "4", "--layers", "1", "--features", "2", "--selector-rank", "8",
            "--selector-top-k", "4", "--anchors", "4", "--steps", "3", "--batch", "2", "--fp32", "--checkpoint-every", "3",
            "--generate-batch", "3"]
    assert main(argv) == 0
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
    info = json.loads((out / "training.json").read_text())  # which data the packaged manifest reports
    made_by = info["sequences_made_by"]
    assert info["sequences_file"] == "sequences.npy" and made_by.startswith("4 windows of 8 corpus tokens (seed 0)")
    assert made_by.endswith("3 at a time)") and np.load(out / "sequences.npy").shape == (4, 24)  # two batches: 3 + 1
    engine = speculant.load_engine({"target": {"path": str(trained_target)},
                                           "drafter": {"kind": "dflash2", "path": str(out)}})
    assert engine.run(prompt_ids=[5, 6, 7], max_new_tokens=6, ignore_eos=True).stats.new_tokens == 6
    # a later run on the cached sequences with another training seed keeps their provenance
    again = tmp_path / "again"
    reuse = [str(again) if a == str(out) else a for a in argv]
    assert main(reuse + ["--sequences-file", str(out / "sequences.npy"), "--seed", "5"]) == 0
    assert json.loads((again / "training.json").read_text())["sequences_made_by"] == made_by
    # a run continued from that one carries the chain of runs behind it
    third = tmp_path / "third"
    chained = [str(third) if a == str(out) else a for a in argv]
    assert main(chained + ["--sequences-file", str(out / "sequences.npy"), "--init-from", str(again)]) == 0
    info = json.loads((third / "training.json").read_text())
    assert info["init_from"] == "again" and info["init_from_training"]["settings"]["seed"] == 5
    assert info["init_from_training"]["sequences_made_by"] == made_by


def test_dflash2_trains_under_bf16_autocast(trained_target, sequences, tmp_path):
    """The default (bf16) path: autocast does not reach into the blockwise vmap, so the attention
    must not mix float32 rotated q/k with bf16 v (this crashed the shipped pair's first build)."""
    from speculant.training import dflash2 as mod

    torch.set_num_threads(1)
    settings = TrainSettings(steps=3, lr=1e-3, bf16=True, checkpoint_every=3)
    draft = mod.train_dflash2(trained_target, sequences, 8, tmp_path / "draft", mod.DFlash2Shape(**SHAPE), settings, batch=2)
    assert (draft / "model.safetensors").exists()


def test_warm_start_from_dflash_drafts_exactly_as_that_dflash(trained_target, sequences, tmp_path):
    from speculant.training import dflash as dflash_mod
    from speculant.training import dflash2 as mod

    torch.set_num_threads(1)
    fp32 = TrainSettings(steps=20, lr=1e-2, bf16=False, checkpoint_every=20)
    source = dflash_mod.train_dflash(trained_target, sequences, 8, tmp_path / "dflash",
                                     dflash_mod.DFlashShape(num_layers=1, block_size=4, num_features=2, anchors_per_sequence=16),
                                     fp32, batch=2)
    shape = mod.DFlash2Shape(**SHAPE)
    cfg = mod.new_dflash2_config(trained_target, tmp_path / "dflash2", shape)
    model = mod.init_dflash2(cfg, seed=3)
    mod.warm_start(model, source, cfg.target_layer_ids)
    mod.save_dflash2(model, tmp_path / "dflash2")
    runs = []
    for kind, path in (("dflash", source), ("dflash2", tmp_path / "dflash2")):
        engine = speculant.load_engine({"target": {"path": str(trained_target)}, "drafter": {"kind": kind, "path": str(path)}})
        result = engine.run(prompt_ids=sequences[0, :8].tolist(), max_new_tokens=32, ignore_eos=True)
        runs.append((result.token_ids, result.stats.acceptance_lengths))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) > len(runs[0][1])  # some drafts were accepted: the comparison is not vacuous

    deeper_cfg = mod.new_dflash2_config(trained_target, tmp_path / "deep", mod.DFlash2Shape(**{**SHAPE, "num_layers": 2}))
    with pytest.raises(ValueError, match="does not match this draft's shape"):
        mod.warm_start(mod.init_dflash2(deeper_cfg, 0), source, deeper_cfg.target_layer_ids)
    other = (0, 2)  # same width as the source's [1, 1], other layers: the weights fit but mean something else
    other_cfg = mod.new_dflash2_config(trained_target, tmp_path / "other", mod.DFlash2Shape(**{**SHAPE, "target_layer_ids": other}))
    with pytest.raises(ValueError, match="reads target layers"):
        mod.warm_start(mod.init_dflash2(other_cfg, 0), source, other_cfg.target_layer_ids)


def test_a_batch_in_one_forward_equals_each_sequence_alone(trained_target, sequences, tmp_path):
    """The trainers run a whole batch as one forward (sequences laid end to end, each block masked
    to its own sequence): DFlash and DFlash2 rows, and the losses, equal those of each sequence
    alone, with different anchor counts per sequence, sliding-window layers too."""
    from speculant.core.types import Capture
    from speculant.training.dflash import Blocks, block_loss, draft_forward
    from speculant.training.dflash2 import blockwise, dflash2_loss
    from speculant.training.features import capture_batch, load_frozen_target

    from speculant.drafters.dflash.torch import DFlashModel

    cfg, model = fresh_draft(trained_target, tmp_path / "v2")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    v1 = DFlashModel(cfg)
    v1.load_state_dict({k: v for k, v in model.state_dict().items() if k in v1.state_dict()}, strict=True)
    target = load_frozen_target(trained_target)
    ids = torch.from_numpy(sequences[:3].astype(np.int64))
    features, _ = capture_batch(target, ids, Capture(tuple(cfg.target_layer_ids)))
    anchors = [torch.tensor([7, 8, 20]), torch.tensor([3]), torch.tensor([5, 11, 12, 30])]
    for window in (None, 6):
        for layer in [*model.layers, *v1.layers]:
            layer.window = window
        for draft, run_layer in ((v1, None), (model, blockwise(cfg.block_size))):  # DFlash2 runs block by block
            with torch.no_grad():
                together = draft_forward(draft, target, features, ids, anchors, cfg, run_layer=run_layer)
                alone = torch.cat([draft_forward(draft, target, features[i], ids[i], anchors[i], cfg, run_layer=run_layer)
                                   for i in range(3)])
            torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    blocks = Blocks.of(ids, anchors)
    assert blocks.labels(cfg.block_size)[3].tolist() == ids[1, 4:7].tolist()  # sequence 1's block at anchor 3
    with torch.no_grad():
        batch_loss, _ = block_loss(v1, target, features, ids, anchors, cfg)
        per_block = [block_loss(v1, target, features[i], ids[i], anchors[i], cfg)[0] * len(anchors[i]) for i in range(3)]
        torch.testing.assert_close(batch_loss, sum(per_block) / 8)  # every block weighs the same
        both, metrics = dflash2_loss(model, target, features, ids, anchors, cfg, 1.0)
    assert torch.isfinite(both) and set(metrics) == {"acc1", "selector", "candidate_recall"}
