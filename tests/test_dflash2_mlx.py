"""DFlash2 on MLX: lossless greedy decoding, and PyTorch/MLX parity of proposals, tokens and
acceptance lengths (greedy, and sampled with one seed: the walk runs on the host with host
uniforms on both backends)."""

from __future__ import annotations

import numpy as np
import pytest

import speculant

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

PROMPTS = {"one_token": [5], "short": [5, 6, 7], "longer_than_window": list(range(20, 52))}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2, build_tiny_dflash2_pair

    root = tmp_path_factory.mktemp("dflash2_mlx")
    target, draft = build_tiny_dflash2_pair(root, block_size=8, sliding_window=8)
    kwargs = dict(seed=7, block_size=8, sliding_window=8)
    return {
        "target": target,
        "dflash2": draft,
        "selector": build_tiny_dflash2(root / "selector", target, output_multiplier=0.05, **kwargs),
        "weight": build_tiny_dflash2(root / "weight", target, codebook_suffix=".weight", **kwargs),
        "rank32": build_tiny_dflash2(root / "rank32", target, selector_rank=32, **kwargs),
    }


def engine(kind, target, draft=None, **drafter):
    config = {"backend": {"kind": kind, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": "dflash2", "path": str(draft), **drafter}
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def engines(pair):
    out = {("mlx", "plain"): engine("mlx", pair["target"])}
    for kind in ("torch", "mlx"):
        for name in ("dflash2", "selector"):
            out[kind, name] = engine(kind, pair["target"], pair[name])
    return out


def recording(eng, **kwargs):
    proposals = []
    propose = eng.drafter.propose

    def record(request):
        draft = propose(request)
        proposals.append(eng.backend.ops.to_list(draft.token_ids))
        return draft

    eng.drafter.propose = record
    try:
        return eng.run(**kwargs), proposals
    finally:
        del eng.drafter.propose


def test_default_block_is_five_on_mlx_and_the_trained_block_is_allowed(engines):
    assert engines["mlx", "dflash2"].block_size == 5
    assert engines["torch", "dflash2"].block_size == 8
    result = engines["mlx", "dflash2"].run(prompt_ids=[5, 6, 7], max_new_tokens=30, block_size=8, ignore_eos=True)
    assert max(result.stats.acceptance_lengths) <= 8
    with pytest.raises(ValueError, match="block_size: 9 is outside 2..8"):
        engines["mlx", "dflash2"].run(prompt_ids=[5], max_new_tokens=4, block_size=9)


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_greedy_equals_plain_on_mlx(engines, prompt, block_size):
    ids = PROMPTS[prompt]
    plain = engines["mlx", "plain"].run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True).token_ids
    result = engines["mlx", "dflash2"].run(prompt_ids=ids, max_new_tokens=40, block_size=block_size, ignore_eos=True)
    assert result.token_ids == plain
    assert result.stats.new_tokens == 40 == 1 + sum(result.stats.acceptance_lengths)


@pytest.mark.parametrize("max_new", [1, 2, 4, 13])
def test_max_new_tokens_and_stop_inside_a_block_on_mlx(engines, max_new):
    ids = PROMPTS["short"]
    plain = engines["mlx", "plain"].run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True).token_ids
    result = engines["mlx", "dflash2"].run(prompt_ids=ids, max_new_tokens=max_new, ignore_eos=True)
    assert result.token_ids == plain[:max_new]
    stop = next(t for i, t in enumerate(plain) if i >= 3 and t not in plain[:i])
    stopped = engines["mlx", "dflash2"].run(prompt_ids=ids, max_new_tokens=40, stop_token_ids=[stop], ignore_eos=True)
    assert stopped.token_ids == plain[: plain.index(stop) + 1]


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
@pytest.mark.parametrize("block_size", [2, 5, 8])
@pytest.mark.parametrize("draft", ["dflash2", "selector"])
def test_torch_mlx_parity_greedy(engines, draft, block_size, prompt):
    kwargs = dict(prompt_ids=PROMPTS[prompt], max_new_tokens=40, block_size=block_size, ignore_eos=True)
    on_torch, torch_props = recording(engines["torch", draft], **kwargs)
    on_mlx, mlx_props = recording(engines["mlx", draft], **kwargs)
    assert on_mlx.token_ids == on_torch.token_ids
    assert on_mlx.stats.acceptance_lengths == on_torch.stats.acceptance_lengths
    assert mlx_props == torch_props


@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.5, 0.9)])
@pytest.mark.parametrize("draft", ["dflash2", "selector"])
def test_torch_mlx_parity_sampled(engines, draft, temperature, top_p):
    kwargs = dict(prompt_ids=PROMPTS["longer_than_window"], max_new_tokens=40, block_size=6, ignore_eos=True,
                  temperature=temperature, top_p=top_p, seed=5)
    on_torch, torch_props = recording(engines["torch", draft], **kwargs)
    on_mlx, mlx_props = recording(engines["mlx", draft], **kwargs)
    assert on_mlx.token_ids == on_torch.token_ids
    assert on_mlx.stats.acceptance_lengths == on_torch.stats.acceptance_lengths
    assert mlx_props == torch_props


def test_sampled_draft_on_mlx_is_sparse_with_the_same_q_as_torch(engines):
    import mlx.core as mx

    from speculant.core.types import DraftRequest, ProposalKind, SamplingParams

    prompt = PROMPTS["short"]
    drafts = {}
    for kind in ("torch", "mlx"):
        eng = engines[kind, "selector"]
        eng.target.reset()
        out = eng.target.prefill(prompt, eng.drafter.info.capture)
        eng.drafter.prefill(prompt, out, 9)
        drafts[kind] = eng.drafter.propose(DraftRequest(9, len(prompt), 4, SamplingParams(1.0), np.random.default_rng(2)))
    d = drafts["mlx"]
    assert d.kind is ProposalKind.SPARSE and isinstance(d.draft_probs, mx.array)
    assert d.candidate_ids.dtype == mx.int32
    np.testing.assert_array_equal(np.array(d.candidate_ids), drafts["torch"].candidate_ids.numpy())
    np.testing.assert_allclose(np.array(d.draft_probs), drafts["torch"].draft_probs.numpy(), rtol=1e-4, atol=1e-6)
    assert np.array(d.token_ids).tolist() == drafts["torch"].token_ids.tolist()


def test_both_codebook_spellings_load_on_mlx(engines, pair):
    weight = engine("mlx", pair["target"], pair["weight"])
    kwargs = dict(prompt_ids=PROMPTS["short"], max_new_tokens=24, ignore_eos=True)
    ours, props = recording(weight, **kwargs)
    ref, ref_props = recording(engines["mlx", "dflash2"], **kwargs)
    assert ours.token_ids == ref.token_ids and props == ref_props


@pytest.mark.parametrize("spec", ["w8a32:gs64", "w4a16:gs32"])
def test_quantized_draft_stays_lossless_and_keeps_selector_and_convs_float(pair, spec):
    import mlx.nn as nn

    eng = engine("mlx", pair["target"], pair["dflash2"], quantization=spec)
    model = eng.drafter.model
    assert isinstance(model.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    assert not isinstance(model.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    assert not isinstance(model.candidate_selector.hidden_projection, nn.QuantizedLinear)
    plain = engine("mlx", pair["target"]).run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True)
    assert eng.run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True).token_ids == plain.token_ids


def test_convolution_matches_torch(torch_threads):
    import mlx.core as mx
    import torch

    from speculant.drafters.dflash2.mlx import GroupedDynamicConv as MLXConv
    from speculant.drafters.dflash2.torch import GroupedDynamicConv as TorchConv

    rng = np.random.default_rng(0)
    base = rng.standard_normal((2, 3, 32)).astype(np.float32)
    proj = rng.standard_normal((2 * 3 * 4, 32)).astype(np.float32)
    x, y = rng.standard_normal((5, 32)).astype(np.float32), rng.standard_normal((5, 32)).astype(np.float32)
    t, m = TorchConv(32, 3, 8), MLXConv(32, 3, 8)
    with torch.no_grad():
        t.base_kernel.copy_(torch.from_numpy(base))
        t.kernel_projection.weight.copy_(torch.from_numpy(proj))
        t_out, t_taps = t.prepare(torch.from_numpy(x))
        t_fin = t.finish(torch.from_numpy(y), t_taps)
    m.base_kernel, m.kernel_projection.weight = mx.array(base), mx.array(proj)
    m_out, m_taps = m.prepare(mx.array(x)[None])
    m_fin = m.finish(mx.array(y)[None], m_taps)
    np.testing.assert_allclose(np.array(m_out[0]), t_out.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(m_fin[0]), t_fin.numpy(), rtol=1e-5, atol=1e-5)


def test_quantize_all_also_quantizes_the_selector_and_convs_and_stays_lossless(pair):
    import mlx.core as mx
    import mlx.nn as nn

    floating = engine("mlx", pair["target"], pair["rank32"]).drafter.model.candidate_selector
    eng = engine("mlx", pair["target"], pair["rank32"], quantization="w8a32:gs32:all")
    model = eng.drafter.model
    selector = model.candidate_selector
    assert isinstance(model.layers[0].attention_conv.kernel_projection, nn.QuantizedLinear)
    assert isinstance(selector.hidden_projection, nn.QuantizedLinear)
    for name in ("predecessor_codebook", "successor_codebook"):
        assert isinstance(getattr(selector, name), nn.QuantizedEmbedding)
        ids = mx.array([[3, 9], [0, 40]])
        rows, exact = np.array(selector.rows(name, ids)), np.array(floating.rows(name, ids))
        assert rows.shape == exact.shape == (2, 2, 32) and not np.array_equal(rows, exact)
        np.testing.assert_allclose(rows, exact, atol=0.05 * np.abs(exact).max())  # 8-bit rounding only
        assert selector.rows(name, mx.zeros((0, 4), mx.int32)).shape == (0, 4, 32)  # a one-token round
        assert selector.rows(name, 3).shape == (32,)  # the anchor
    plain = engine("mlx", pair["target"]).run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True)
    assert eng.run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True).token_ids == plain.token_ids


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_quantize_all_needs_a_selector_rank_the_group_size_divides(pair, backend):
    from speculant.api import validate

    def problems(draft, spec):
        cfg = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(pair["target"])},
               "drafter": {"kind": "dflash2", "path": str(draft), "quantization": spec}}
        return [p for p in validate(cfg).errors if p.field == "drafter.quantization.group_size"]

    if backend == "torch":
        pytest.importorskip("torchao")
    [problem] = problems(pair["dflash2"], "w8a32:gs32:all")  # selector_rank 16
    assert "candidate_selector.predecessor_codebook (16)" in problem.message and "drop ':all'" in problem.fix
    assert not problems(pair["dflash2"], "w8a32:gs32") and not problems(pair["rank32"], "w8a32:gs32:all")
