"""Muse Glimmer's own DFlash assistant (``muse_glimmer_assistant``) as speculant's dflash drafter.

On one tiny random Muse Glimmer target and assistant (a planted bias, so drafts are partly
accepted), speculant's greedy output equals transformers' native DFlash ``generate`` and its
plain greedy, and every full-block draft and its acceptance length equal transformers' own.
"""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers.models.muse_glimmer_assistant")

import torch  # noqa: E402
from transformers.generation import candidate_generator  # noqa: E402

import speculant  # noqa: E402
from speculant.api import validate  # noqa: E402
from engine_recording import run_recording_proposals  # noqa: E402

NEW_TOKENS = 64
BLOCK = 16
PROMPTS = {
    "shorter_than_windows": [5, 6, 7, 8, 9],  # assistant window 8, target window 16
    "longer_than_windows": list(range(20, 60)),
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny_muse_glimmer import build_tiny_muse_glimmer_assistant, build_tiny_muse_glimmer_pair

    root = tmp_path_factory.mktemp("muse_glimmer")
    target, assistant = build_tiny_muse_glimmer_pair(root, planted=1.5)
    # reads the target's last layer too, which transformers hands over final-normed
    last = build_tiny_muse_glimmer_assistant(root / "last_layer", target, seed=2, target_layer_ids=[1, 3])
    return {"target": target, "assistant": assistant, "last_layer": last}


def config_for(target, assistant=None, backend="torch") -> dict:
    config = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
              "verifier": {"kind": "greedy"}}
    if assistant is not None:
        config["drafter"] = {"kind": "dflash", "path": str(assistant), "block_size": BLOCK,
                             "lookup": False}
    return config


@pytest.fixture(scope="module")
def hf_target(pair):
    from transformers import MuseGlimmerForConditionalGeneration

    return MuseGlimmerForConditionalGeneration.from_pretrained(str(pair["target"]), dtype=torch.float32).eval()


def hf_assistant(path):
    from transformers import MuseGlimmerAssistantModel

    return MuseGlimmerAssistantModel.from_pretrained(str(path), dtype=torch.float32).eval()


class ChunkSizes:
    """A ``generate`` streamer keeping only how many tokens each put carried."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def put(self, ids) -> None:
        self.sizes.append(int(ids.shape[-1]))

    def end(self) -> None:
        pass


def native_dflash(target, assistant, prompt, monkeypatch):
    """transformers' DFlash generate: (new tokens, drafts per cycle, tokens gained per cycle)."""
    drafts = []
    get_candidates = candidate_generator.DFlashTokenCandidateGenerator.get_candidates

    def recording(self, input_ids, **kwargs):
        ids, logits = get_candidates(self, input_ids, **kwargs)
        if logits is not None:
            drafts.append(ids[0, input_ids.shape[1]:].tolist())
        return ids, logits

    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", recording)
    streamer = ChunkSizes()
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              assistant_model=assistant, speculation_type="dflash", streamer=streamer)
    # puts: the prompt, the prefill's token, then one put per drafting cycle
    return out[0, len(prompt):].tolist(), drafts, streamer.sizes[2:]


def plain_greedy(target, prompt):
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("assistant, prompt", [("assistant", "shorter_than_windows"),
                                               ("assistant", "longer_than_windows"),
                                               ("last_layer", "longer_than_windows")])
def test_greedy_equals_native_dflash_and_plain(pair, hf_target, assistant, prompt, monkeypatch):
    ids = PROMPTS[prompt]
    engine = speculant.load_engine(config_for(pair["target"], pair[assistant]))
    result, drafts = run_recording_proposals(engine, prompt_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    native, native_drafts, native_gains = native_dflash(hf_target, hf_assistant(pair[assistant]), ids, monkeypatch)
    assert len(native) == NEW_TOKENS
    assert result.token_ids == native == plain_greedy(hf_target, ids)

    accepted = result.stats.acceptance_lengths
    # the last cycle may have nothing to draft (one token left): a plain step, no proposal
    assert len(accepted) - 1 <= len(drafts) <= len(accepted)
    # transformers always drafts block - 1 tokens; speculant shortens the last blocks to the
    # tokens still wanted, and a shorter bidirectional block drafts differently
    full = [i for i, d in enumerate(drafts) if len(d) == BLOCK - 1 and i < len(native_drafts)]
    assert len(full) >= len(drafts) - BLOCK
    assert [drafts[i] for i in full] == [native_drafts[i] for i in full]
    assert [accepted[i] for i in full] == [native_gains[i] for i in full]
    assert 1 in accepted and max(accepted) > 1  # partial acceptance: the comparison means something


# -- what describe() says before any weights load ---------------------------------------------
def problem_texts(config) -> list[str]:
    return [str(p) for p in validate(config).problems]


def test_describe_reads_the_assistant_layout(pair):
    report = validate(config_for(pair["target"], pair["assistant"]))
    assert report.problems == [], [str(p) for p in report.problems]
    info = report.drafter
    raw = json.loads((pair["assistant"] / "config.json").read_text())
    assert info.kind == "dflash" and info.trained_block_size == raw["block_size"] == BLOCK
    assert info.target_layer_ids == tuple(raw["target_layer_ids"]) and info.mask_token_id == raw["mask_token_id"]
    cfg = info.extra["config"]
    assert cfg.is_muse_glimmer and cfg.is_causal is False
    assert cfg.sliding_window == raw["sliding_window"] + 1  # transformers keeps |q - k| <= window


# -- MLX: the same drafts and tokens as PyTorch -------------------------------------------------
@pytest.mark.mlx
@pytest.mark.parametrize("assistant, prompt", [("assistant", "shorter_than_windows"),
                                               ("assistant", "longer_than_windows"),
                                               ("last_layer", "longer_than_windows")])
def test_mlx_drafts_and_tokens_equal_torch(pair, assistant, prompt):
    """The assistant on MLX (bare embedding rows, renamed tensors, inclusive window, the
    final-normed last layer) proposes what it proposes on PyTorch, cycle for cycle."""
    pytest.importorskip("mlx_lm.models.muse_glimmer")
    ids = PROMPTS[prompt]
    runs = {}
    for backend in ("torch", "mlx"):
        engine = speculant.load_engine(config_for(pair["target"], pair[assistant], backend=backend))
        runs[backend] = run_recording_proposals(engine, prompt_ids=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    (torch_result, torch_drafts), (mlx_result, mlx_drafts) = runs["torch"], runs["mlx"]
    assert mlx_result.token_ids == torch_result.token_ids
    assert mlx_drafts == torch_drafts
    assert mlx_result.stats.acceptance_lengths == torch_result.stats.acceptance_lengths
    assert 1 in mlx_result.stats.acceptance_lengths and max(mlx_result.stats.acceptance_lengths) > 1


@pytest.mark.mlx
def test_mlx_embed_applies_the_embed_norm_and_raw_rows_skip_it(pair):
    """``embed`` gives the rows Muse Glimmer's first layer reads (after its weightless
    ``embed_norm``), as transformers' embedding module does; ``raw`` the table's rows."""
    pytest.importorskip("mlx_lm.models.muse_glimmer")
    import numpy as np

    ids = PROMPTS["longer_than_windows"]
    targets = {b: speculant.load_engine(config_for(pair["target"], backend=b)).target for b in ("torch", "mlx")}
    rows = {(b, raw): np.array(t.backend.ops.to_list(t.embed(t.backend.int_array(ids), raw=raw)))
            for b, t in targets.items() for raw in (False, True)}
    for raw in (False, True):
        np.testing.assert_allclose(rows["mlx", raw], rows["torch", raw], rtol=1e-5, atol=1e-6)
    assert not np.allclose(rows["torch", True], rows["torch", False])


def test_describe_rejects_another_target_family(pair, tmp_path):
    from speculant.testing.tiny_families import build_tiny_family

    llama = build_tiny_family(tmp_path / "llama", "llama")
    texts = problem_texts(config_for(llama, pair["assistant"]))
    assert any("Muse Glimmer target" in t and "llama" in t for t in texts), texts


def test_describe_reports_hidden_size_and_missing_tensors(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    wrong = shutil.copytree(pair["assistant"], tmp_path / "wrong")
    raw = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**raw, "hidden_size": raw["hidden_size"] * 2}))
    texts = problem_texts(config_for(pair["target"], wrong))
    assert any("hidden_size" in t for t in texts) and any("encoder.fc.weight has shape" in t for t in texts), texts

    holed = shutil.copytree(pair["assistant"], tmp_path / "holed")
    tensors = load_file(str(holed / "model.safetensors"))
    del tensors["encoder.output_norm_enc.weight"]
    save_file(tensors, str(holed / "model.safetensors"), metadata={"format": "pt"})
    texts = problem_texts(config_for(pair["target"], holed))
    assert any("missing tensor encoder.output_norm_enc.weight" in t for t in texts), texts
