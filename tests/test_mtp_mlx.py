"""The MTP drafter on MLX (CPU, float32): both layouts load, the forward matches PyTorch's (which
test_mtp_forward checks against a float64 reference), greedy output equals plain MLX decoding,
and PyTorch and MLX agree token for token and cycle for cycle, also when sampling with one seed.

mlx-lm loads a Qwen3 target strictly (its sanitize keeps unknown ``mtp.*`` tensors, unlike the
Qwen3-Next/3.5, DeepSeek-V3 and GLM loaders, which drop them), so the tiny Qwen3 targets here
keep their MTP weights in a separate folder.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.core.types import DraftRequest, SamplingParams
from speculant.api import validate
from speculant.testing.tiny_mtp import bigram_mtp, build_bigram_target, canonical_mtp, mtp_tensors, write_mtp

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytestmark = pytest.mark.mlx


def config(kind, target, folder, **options):
    return {"backend": {"kind": kind, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
            "drafter": {"kind": "mtp", "path": str(folder), "options": options}}


def engine(kind, target, folder=None, **options):
    if folder is None:
        return speculant.load_engine({"backend": {"kind": kind, "device": "cpu", "dtype": "float32"},
                                             "target": {"path": str(target)}})
    return speculant.load_engine(config(kind, target, folder, **options))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_threads):
    """A bigram target with context-dependent layers and MTP folders with partial acceptance."""
    root = tmp_path_factory.mktemp("mtp_mlx")
    target, cycle = build_bigram_target(root / "target", layer_scale=0.1)
    folders = {}
    for layout, layers in (("qwen", 1), ("deepseek", 2)):
        canonical = bigram_mtp(target, cycle, path="token", num_layers=layers, block_scale=1.0, seed=3)
        folders[layout] = write_mtp(target, mtp_tensors(canonical, layout, 4), layout, layers, folder=root / f"mtp_{layout}")
    engines = {(kind, name): engine(kind, target, folders[name]) for kind in ("torch", "mlx") for name in folders}
    engines["mlx", "plain"] = engine("mlx", target)
    return {"target": target, "cycle": cycle, "folders": folders, "engines": engines, "root": root}


@pytest.mark.parametrize("layout", ["qwen", "deepseek"])
def test_both_layouts_validate_for_mlx(pair, layout):
    report = validate(config("mlx", pair["target"], pair["folders"][layout]))
    assert report.ok, [str(p) for p in report.errors]
    assert pair["engines"]["mlx", layout].drafter.net.__class__.__name__ == "MLXMTPNetwork"


def test_mtp_in_a_strict_mlx_target_folder_is_flagged(pair, tmp_path):
    from speculant.testing.tiny_mtp import copy_target

    target = copy_target(pair["target"], tmp_path / "target")
    write_mtp(target, mtp_tensors(canonical_mtp(target, 1, seed=1), "qwen"), "qwen", 1)
    report = validate({"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)},
                       "drafter": {"kind": "mtp"}})
    assert report.ok and any("mlx-lm's qwen3 loader" in p.message for p in report.warnings)
    torch_report = validate({"target": {"path": str(target)}, "drafter": {"kind": "mtp"}})
    assert not torch_report.warnings


def sampled_q(eng, prompt, first, k):
    capture = eng.drafter.info.capture
    eng.target.reset()
    out = eng.target.prefill(prompt, capture)
    eng.drafter.prefill(prompt, out, first)
    draft = eng.drafter.propose(DraftRequest(first, len(prompt), k, SamplingParams(temperature=1.0), np.random.default_rng(0)))
    return eng.backend.ops.to_numpy(draft.draft_probs), eng.backend.ops.to_list(draft.token_ids)


@pytest.mark.parametrize("layout,layers,gated", [("qwen", 1, False), ("qwen", 2, True), ("deepseek", 2, False)])
def test_forward_matches_torch(pair, layout, layers, gated):
    """Random full-scale MTP weights (softer q), recursion over every layer, optional output gate."""
    target = pair["target"]
    canonical = canonical_mtp(target, layers, seed=21, gated=gated, num_heads=1 if layout == "qwen" else layers)
    updates = {"attn_output_gate": True, "partial_rotary_factor": 0.25} if gated else {}
    folder = write_mtp(target, mtp_tensors(canonical, layout, 4), layout, layers,
                       folder=pair["root"] / f"fwd_{layout}{layers}{gated}", config_updates=updates)
    prompt = [17, 4, 99, 250, 3, 61, 8]
    q_torch, tok_torch = sampled_q(engine("torch", target, folder, sample_drafts=True), prompt, 42, 4)
    q_mlx, tok_mlx = sampled_q(engine("mlx", target, folder, sample_drafts=True), prompt, 42, 4)
    assert tok_mlx == tok_torch
    np.testing.assert_allclose(q_mlx, q_torch, atol=2e-5, rtol=0)


def test_pre_shifted_folder_is_not_shifted_twice_on_mlx(pair):
    target = pair["target"]
    canonical = canonical_mtp(target, 1, seed=22)
    raw = write_mtp(target, mtp_tensors(canonical, "qwen"), "qwen", 1, folder=pair["root"] / "raw")
    shifted = write_mtp(target, mtp_tensors(canonical, "qwen", shifted=True), "qwen", 1, folder=pair["root"] / "shifted", shifted=True)
    prompt = [5, 6, 7]
    q_raw, _ = sampled_q(engine("mlx", target, raw, sample_drafts=True), prompt, 9, 2)
    q_shifted, _ = sampled_q(engine("mlx", target, shifted, sample_drafts=True), prompt, 9, 2)
    np.testing.assert_allclose(q_shifted, q_raw, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", ["qwen", "deepseek"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("prompt_length", [1, 7])
def test_greedy_equals_plain_and_matches_torch(pair, layout, k, prompt_length):
    ids = [int(t) for t in np.random.default_rng(prompt_length).choice(pair["cycle"] + list(range(20, 60)), size=prompt_length)]
    kwargs = dict(prompt_ids=ids, max_new_tokens=40, ignore_eos=True)
    plain = pair["engines"]["mlx", "plain"].run(**kwargs).token_ids
    on_mlx = pair["engines"]["mlx", layout].run(block_size=k + 1, **kwargs)
    on_torch = pair["engines"]["torch", layout].run(block_size=k + 1, **kwargs)
    assert on_mlx.token_ids == plain
    assert on_mlx.token_ids == on_torch.token_ids
    assert on_mlx.stats.acceptance_lengths == on_torch.stats.acceptance_lengths
    assert max(on_mlx.stats.acceptance_lengths) > 1  # accepted drafts are part of the comparison


def test_exact_bigram_mtp_is_always_accepted_on_mlx(tmp_path, torch_threads):
    target, cycle = build_bigram_target(tmp_path / "target", layer_scale=1e-3)
    folder = write_mtp(target, mtp_tensors(bigram_mtp(target, cycle, path="hidden"), "deepseek", 4), "deepseek", 1,
                       folder=tmp_path / "mtp")
    result = engine("mlx", target, folder).run(prompt_ids=cycle[:5], max_new_tokens=30, ignore_eos=True, block_size=4)
    assert result.token_ids == [cycle[(5 + i) % len(cycle)] for i in range(30)]
    assert result.stats.per_position_acceptance == [1.0, 1.0, 1.0]


def test_drafter_cache_matches_a_fresh_prefill_on_mlx(pair):
    live, fresh = engine("mlx", pair["target"], pair["folders"]["deepseek"]), engine("mlx", pair["target"], pair["folders"]["deepseek"])
    result = live.run(prompt_ids=pair["cycle"][:6], max_new_tokens=25, ignore_eos=True, block_size=4)
    assert sum(result.stats.acceptance_lengths) > len(result.stats.acceptance_lengths)  # some drafts were accepted
    committed = list(pair["cycle"][:6]) + result.token_ids
    position = len(committed) - 1
    if result.stats.stop_reason == "max_new_tokens":
        # the engine stopped after the last cycle's commit: the drafter holds the whole sequence
        assert live.drafter.cache_lengths == [position, position - 1]
        capture = fresh.drafter.info.capture
        out = fresh.target.prefill(committed[:-1], capture)
        fresh.drafter.prefill(committed[:-1], out, committed[-1])
        request = DraftRequest(committed[-1], position, 3)
        ops = live.backend.ops
        assert ops.to_list(live.drafter.propose(request).token_ids) == ops.to_list(fresh.drafter.propose(request).token_ids)


@pytest.mark.parametrize("sample_drafts", [False, True])
def test_seeded_sampling_matches_torch(pair, sample_drafts):
    kwargs = dict(prompt_ids=pair["cycle"][:4], max_new_tokens=30, ignore_eos=True, block_size=3,
                  temperature=1.0, top_p=0.95, seed=7)
    runs = {kind: engine(kind, pair["target"], pair["folders"]["qwen"], sample_drafts=sample_drafts).run(**kwargs)
            for kind in ("torch", "mlx")}
    assert runs["mlx"].token_ids == runs["torch"].token_ids
    assert runs["mlx"].stats.acceptance_lengths == runs["torch"].stats.acceptance_lengths


@pytest.mark.parametrize("layout", ["qwen", "deepseek"])
def test_compiled_steps_draft_what_eager_steps_draft(pair, layout):
    """Where the target's whole forward runs compiled (``backend.compile: auto`` on a CPU), the MTP
    steps run compiled too (mlx_compiled.py). Every cycle's drafts, the acceptance lengths and the
    tokens equal the eager steps' (``compile: off``), over a request that grows the buffers several
    times and crops rejected drafts every cycle."""
    target, folder = pair["target"], pair["folders"][layout]
    compiled = pair["engines"]["mlx", layout]
    assert compiled.drafter.fast_path.startswith("compiled MTP steps"), compiled.drafter.fast_path
    eager = speculant.load_engine({**config("mlx", target, folder), "backend": {"kind": "mlx", "device": "cpu",
                                                                                 "dtype": "float32", "compile": "off"}})
    assert eager.drafter.net.compiled is None
    runs = []
    for engine in (compiled, eager):
        drafts, propose = [], engine.drafter.propose

        def recording(request, propose=propose, drafts=drafts):
            draft = propose(request)
            drafts.append(engine.backend.ops.to_list(draft.token_ids))
            return draft

        engine.drafter.propose = recording
        try:
            result = engine.run(prompt_ids=pair["cycle"][:5] + [30, 31], max_new_tokens=200, ignore_eos=True, block_size=4)
        finally:
            del engine.drafter.propose
        runs.append((drafts, result.stats.acceptance_lengths, result.token_ids))
    assert runs[0] == runs[1]
    assert 0 < sum(a < 3 for a in runs[0][1]) < len(runs[0][1])  # drafts partly rejected: crops happened
    assert compiled.drafter.net.compiled.arrays(0)[0].shape[2] > 64  # the buffers grew


def test_compiled_steps_after_fully_rejected_blocks(pair):
    """In a 2-layer chain, layer 0 drafts at ``b + 2`` and does not hold ``b + 1``. A rejected
    block's draft that layer 0 wrote at what becomes ``b + 1`` must not be seen by the next cycle's
    draft there: every logits row the compiled steps give equals the eager steps' over cycles that
    commit one token each."""
    target, folder = pair["target"], pair["folders"]["deepseek"]
    eager = speculant.load_engine({**config("mlx", target, folder), "backend": {"kind": "mlx", "device": "cpu",
                                                                                 "dtype": "float32", "compile": "off"}})
    compiled = pair["engines"]["mlx", "deepseek"]
    assert compiled.drafter.net.compiled is not None and eager.drafter.net.compiled is None
    rows = []
    for engine in (compiled, eager):
        t, d, ops = engine.target, engine.drafter, engine.backend.ops
        capture, seen, logits = d.info.capture, [], d.net.logits

        def recording(hidden, logits=logits, seen=seen):
            out = logits(hidden)
            seen.append(np.array(out))
            return out

        d.net.logits = recording
        try:
            ids = list(pair["cycle"][:6])
            t.reset()
            d.prefill(ids[:-1], t.prefill(ids[:-1], capture), ids[-1])
            anchor, position = ids[-1], len(ids) - 1
            for _ in range(6):
                draft = ops.to_list(d.propose(DraftRequest(anchor, position, 3)).token_ids)
                out = t.forward(engine.backend.int_array([anchor]), capture)
                t.crop(position + 1)
                anchor, position = (draft[0] + 1) % 64, position + 1  # every draft rejected
                d.commit(out, 1, [anchor])
        finally:
            del d.net.logits
        rows.append(seen)
    assert len(rows[0]) == len(rows[1]) == 18
    for got, want in zip(*rows):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
