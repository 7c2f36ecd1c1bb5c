"""DFlash2 on PyTorch is lossless: greedy output equals plain greedy decoding token for token
(the spine's catalogue), and sampled output follows the target's distribution."""

from __future__ import annotations

import numpy as np
import pytest

import speculant

PROMPTS = {
    "one_token": [5],
    "short": [5, 6, 7],
    "longer_than_window": list(range(20, 52)),  # 32 tokens > the draft's sliding window of 8
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_threads):
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2, build_tiny_dflash2_pair

    root = tmp_path_factory.mktemp("dflash2_lossless")
    target, draft = build_tiny_dflash2_pair(root, block_size=8, sliding_window=8)
    wide = build_tiny_dflash2(root / "dflash2_wide", target, seed=11, block_size=8, sliding_window=2048)
    sampling = build_tiny_dflash2(root / "dflash2_sampling", target, seed=7, block_size=8, sliding_window=8,
                                  output_multiplier=0.1)
    rank32 = build_tiny_dflash2(root / "dflash2_rank32", target, seed=7, block_size=8, sliding_window=8, selector_rank=32)
    return {"target": target, "dflash2": draft, "dflash2_wide": wide, "dflash2_sampling": sampling, "dflash2_rank32": rank32}


def engine(target, draft=None):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": "dflash2", "path": str(draft)}
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def engines(pair):
    return {"plain": engine(pair["target"]), "dflash2": engine(pair["target"], pair["dflash2"]),
            "dflash2_wide": engine(pair["target"], pair["dflash2_wide"])}


def plain_tokens(engines, prompt, n, **kw):
    return engines["plain"].run(prompt_ids=prompt, max_new_tokens=n, **kw).token_ids


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("drafter", ["dflash2", "dflash2_wide"])
def test_greedy_equals_plain(engines, prompt, block_size, drafter):
    ids = PROMPTS[prompt]
    expected = plain_tokens(engines, ids, 40, ignore_eos=True)
    result = engines[drafter].run(prompt_ids=ids, max_new_tokens=40, block_size=block_size, ignore_eos=True)
    assert result.token_ids == expected
    stats = result.stats
    assert stats.new_tokens == 40 == 1 + sum(stats.acceptance_lengths)
    assert all(1 <= a <= block_size for a in stats.acceptance_lengths)
    assert stats.stop_reason == "max_new_tokens"


def test_default_block_is_the_trained_block(engines):
    assert engines["dflash2"].block_size == 8


def test_pair_mixes_acceptance_and_rejection(engines):
    lengths = []
    for prompt in PROMPTS.values():
        lengths += engines["dflash2"].run(prompt_ids=prompt, max_new_tokens=60, ignore_eos=True).stats.acceptance_lengths
    assert np.mean(lengths) > 1.5
    assert max(lengths) >= 4 and min(lengths) == 1  # multi-token accepts and rejections both happen


@pytest.mark.parametrize("max_new", [1, 2, 5, 13, 31])
def test_max_new_tokens_inside_a_block(engines, max_new):
    expected = plain_tokens(engines, PROMPTS["short"], max_new, ignore_eos=True)
    result = engines["dflash2"].run(prompt_ids=PROMPTS["short"], max_new_tokens=max_new, ignore_eos=True)
    assert result.token_ids == expected and len(expected) == max_new
    assert result.stats.new_tokens == 1 + sum(result.stats.acceptance_lengths)


def test_stop_token_inside_a_block(engines):
    reference = plain_tokens(engines, PROMPTS["longer_than_window"], 40, ignore_eos=True)
    stop = next(t for i, t in enumerate(reference) if i >= 4 and t not in reference[:i])
    cut = reference.index(stop) + 1
    for block in (4, 8):
        result = engines["dflash2"].run(prompt_ids=PROMPTS["longer_than_window"], max_new_tokens=40,
                                        block_size=block, stop_token_ids=[stop], ignore_eos=True)
        assert result.token_ids == reference[:cut]
        assert result.stats.stop_reason == "eos"


def test_eos_from_target_config_stops(engines):
    eos = engines["plain"].target.info.eos_token_ids
    tokens = engines["dflash2"].run(prompt_ids=PROMPTS["short"], max_new_tokens=40).token_ids
    assert tokens == plain_tokens(engines, PROMPTS["short"], 40)
    assert not any(t in eos for t in tokens[:-1])


# -- sampling ---------------------------------------------------------------------------------


def test_sampled_draft_is_sparse_and_consistent(engines):
    from speculant.core.types import DraftRequest, ProposalKind, SamplingParams

    eng = engines["dflash2"]
    prompt = PROMPTS["short"]
    eng.target.reset()
    out = eng.target.prefill(prompt, eng.drafter.info.capture)
    eng.drafter.prefill(prompt, out, 9)
    k = 7
    draft = eng.drafter.propose(DraftRequest(9, len(prompt), k, SamplingParams(0.7), np.random.default_rng(0)))
    assert draft.kind is ProposalKind.SPARSE and draft.num_tokens == k
    q, cand, tokens = draft.draft_probs.numpy(), draft.candidate_ids.numpy(), draft.token_ids.numpy()
    top_k = eng.drafter.model.candidate_selector.top_k
    assert q.shape == cand.shape == (k, top_k) and q.dtype == np.float32
    np.testing.assert_allclose(q.sum(axis=1), 1.0, rtol=1e-5)
    for t in range(k):
        assert tokens[t] in cand[t]
        assert draft.confidence[t] == pytest.approx(float(q[t][list(cand[t]).index(tokens[t])]))
    assert len(set(cand[0].tolist())) == top_k


def test_seeded_sampling_is_reproducible(engines):
    run = lambda seed: engines["dflash2"].run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True,
                                              temperature=0.8, top_p=0.95, seed=seed).token_ids
    assert run(3) == run(3)
    assert run(3) != run(4)


def exact_distribution(eng, prompt, n, sampling):
    """The target's own probability of every n-token continuation within its top-k."""
    from speculant.core.sampling import target_probs

    ops = eng.backend.ops

    def probs(prefix):
        eng.target.reset()
        return ops.to_numpy(target_probs(ops, eng.target.prefill(prefix).logits[-1:], sampling))[0]

    dist = {(): 1.0}
    for _ in range(n):
        dist = {seq + (t,): p * float(row[t]) for seq, p in dist.items() for row in [probs(prompt + list(seq))]
                for t in np.flatnonzero(row > 0)}
    return dist


# Target top-k 3 at T = 2.5 and a draft whose unary logits are scaled by 0.1: q is spread over
# several candidates and its bilinear part matters, so a wrong q shows in the output.
TEMPERATURE, TOP_K, TRIALS = 2.5, 3, 1000


def sampled_pvalue(eng, plain):
    """Chi-square p-value of all 3-token continuations (tokens 2 and 3 come from one
    draft/verify cycle with the sparse selector q) against the target's exact distribution."""
    from scipy.stats import chisquare

    from speculant.core.types import SamplingParams

    prompt = PROMPTS["short"]
    exact = exact_distribution(plain, prompt, 3, SamplingParams(TEMPERATURE, 1.0, TOP_K))
    counts = {seq: 0 for seq in exact}
    accepted = 0
    for seed in range(TRIALS):
        result = eng.run(prompt_ids=prompt, max_new_tokens=3, block_size=4, ignore_eos=True,
                         temperature=TEMPERATURE, top_k=TOP_K, seed=seed)
        counts[tuple(result.token_ids)] += 1
        accepted += sum(a - 1 for a in result.stats.acceptance_lengths)
    assert accepted > TRIALS * 0.2  # drafts really are accepted, not only resampled
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for seq, p in sorted(exact.items(), key=lambda kv: -kv[1]):
        if p * TRIALS >= 5:
            observed.append(counts[seq])
            expected.append(p * TRIALS)
        else:
            rest_o, rest_e = rest_o + counts[seq], rest_e + p * TRIALS
    observed.append(rest_o)
    expected.append(rest_e)
    assert len(observed) >= 10
    return chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected)).pvalue


@pytest.mark.slow
def test_sampling_follows_the_target_distribution(pair, engines):
    eng = engine(pair["target"], pair["dflash2_sampling"])
    assert sampled_pvalue(eng, engines["plain"]) > 1e-3


@pytest.mark.slow
def test_q_from_unary_logits_is_caught_end_to_end(pair, engines):
    """Broken variant: the recorded q is softmax(U/T) of the draft's unary logits over the
    candidates instead of the selector's softmax(S/T) along the walked path."""
    import torch

    eng = engine(pair["target"], pair["dflash2_sampling"])
    selector, drafter = eng.drafter.model.candidate_selector, eng.drafter
    score_table, propose = selector.score_table, drafter.propose
    seen = {}

    def spy(hidden, logits, anchor_id):
        seen["unary"] = torch.topk(logits.float(), selector.top_k).values
        return score_table(hidden, logits, anchor_id)

    def broken(request):
        draft = propose(request)
        if draft.draft_probs is not None:
            draft.draft_probs = torch.softmax(seen["unary"] / request.sampling.temperature, dim=-1)
        return draft

    selector.score_table, drafter.propose = spy, broken
    assert sampled_pvalue(eng, engines["plain"]) < 1e-6


@pytest.mark.parametrize("spec", ["w8a32:gs64", "w4a16:gs32"])
def test_quantized_draft_stays_lossless_and_keeps_selector_and_convs_float(pair, engines, spec):
    pytest.importorskip("torchao")
    import torch

    eng = speculant.load_engine({
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(pair["target"])},
        "drafter": {"kind": "dflash2", "path": str(pair["dflash2"]), "quantization": spec}})
    model = eng.drafter.model
    assert type(model.layers[0].mlp.gate_proj.weight) is not torch.nn.Parameter  # a torchao tensor
    for module in (model.layers[0].attention_conv.kernel_projection, model.candidate_selector.hidden_projection):
        # not quantized: a plain tensor (a Parameter, or its view where the CPU layout transposed it)
        assert type(module.weight) in (torch.nn.Parameter, torch.Tensor)
    plain = plain_tokens(engines, PROMPTS["short"], 30, ignore_eos=True)
    assert eng.run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True).token_ids == plain


def test_quantize_all_also_quantizes_the_selector_and_convs_and_stays_lossless(pair, engines):
    pytest.importorskip("torchao")
    import torch

    floating = engine(pair["target"], pair["dflash2_rank32"]).drafter.model.candidate_selector
    eng = speculant.load_engine({
        "backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(pair["target"])},
        "drafter": {"kind": "dflash2", "path": str(pair["dflash2_rank32"]),
                    "quantization": {"weight_bits": 8, "activation_bits": 32, "group_size": 32, "quantize_all": True}}})
    model = eng.drafter.model
    selector = model.candidate_selector
    for module in (model.layers[0].attention_conv.kernel_projection, selector.hidden_projection,
                   selector.predecessor_codebook, selector.successor_codebook):
        assert type(module.weight) is not torch.nn.Parameter  # a torchao tensor
    ids = torch.tensor([[3, 9], [0, 40]])
    for name in ("predecessor_codebook", "successor_codebook"):
        with torch.no_grad():
            rows, exact = selector.rows(name, ids), floating.rows(name, ids)
        assert rows.shape == exact.shape == (2, 2, 32) and not torch.equal(rows, exact)
        torch.testing.assert_close(rows, exact, rtol=0, atol=0.05 * exact.abs().max().item())  # 8-bit rounding only
        assert selector.rows(name, torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4, 32)  # a one-token round
        assert selector.rows(name, 3).shape == (32,)  # the anchor
    plain = plain_tokens(engines, PROMPTS["short"], 30, ignore_eos=True)
    assert eng.run(prompt_ids=PROMPTS["short"], max_new_tokens=30, ignore_eos=True).token_ids == plain
