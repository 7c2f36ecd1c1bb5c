"""The MTP drafter on hybrid targets with the published 3 : 1 layer pattern (three Gated DeltaNet
``linear_attention`` layers, then ``full_attention``): Qwen3-Next (MoE, MTP in the target folder),
Qwen3.5 and Qwen3.5-MoE (composite checkpoints: ``text_config``, ``model.language_model.*``,
native ``mtp.*`` tensors beside them, ``mtp_num_hidden_layers`` under ``text_config``).

- Greedy speculative output equals speculant's plain greedy output and transformers'
  ``generate(do_sample=False)`` over 64 new tokens, with partial acceptance (bigram-planted
  target, token-path MTP over a random block), on PyTorch and on MLX.
- The MTP head's own KV cache stays right through rollbacks: after every accept/reject cycle
  its proposals (dense q of every step) equal those of a fresh drafter prefilled with the
  committed sequence, and the same check fails when the MTP cache is not cropped. The target is
  rolled back there by re-prefilling the committed tokens, so this test depends on the drafter
  only, not on the backend's rollback of Gated DeltaNet states.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.core.types import Capture, DraftRequest, SamplingParams
from speculant.api import validate
from speculant.testing.tiny_mtp import build_bigram_target, target_config
from speculant.testing.tiny_mtp_families import build_family_mtp

torch = pytest.importorskip("torch")

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
NEW_TOKENS = 64
BLOCK = 3


def config(kind, target, drafter=True, **options):
    out = {"backend": {"kind": kind, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if drafter:
        out["drafter"] = {"kind": "mtp", "options": options}
    return out


def engine(kind, target, drafter=True, **options):
    return speculant.load_engine(config(kind, target, drafter, **options))


class Pairs:
    """Bigram-planted hybrid targets with their MTP layers in the target folder, built on first use."""

    def __init__(self, root) -> None:
        self.root, self.built = root, {}

    def __getitem__(self, family):
        if family not in self.built:
            target, cycle = build_bigram_target(self.root / family, family=family, hybrid=True, layer_scale=0.1)
            build_family_mtp(target, cycle=cycle, seed=3)
            rng = np.random.default_rng(7)
            prompt = [int(t) for t in rng.choice(cycle + list(range(20, 60)), size=7)]
            self.built[family] = {"target": target, "cycle": cycle, "prompt": prompt}
        return self.built[family]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, torch_threads):
    return Pairs(tmp_path_factory.mktemp("mtp_hybrid"))


@pytest.fixture(scope="module")
def torch_spec(pairs):
    """speculant's speculative run per family (PyTorch), computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            pair = pairs[family]
            cache[family] = engine("torch", pair["target"]).run(prompt_ids=pair["prompt"], max_new_tokens=NEW_TOKENS,
                                                                 ignore_eos=True, block_size=BLOCK)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def torch_plain(pairs):
    """speculant's plain greedy tokens per family (PyTorch), computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            pair = pairs[family]
            cache[family] = engine("torch", pair["target"], drafter=False).run(
                prompt_ids=pair["prompt"], max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        return cache[family]

    return get


def transformers_greedy(target, prompt, new_tokens):
    """transformers' own greedy decoding with the checkpoint's published class."""
    import transformers

    cls = getattr(transformers, target_config(target)["architectures"][0])
    model = cls.from_pretrained(str(target), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_the_targets_have_the_published_layouts(pairs):
    from speculant.core.checkpoint import tensor_inventory
    from speculant.core.validator import read_target_info

    for family in FAMILIES:
        target = pairs[family]["target"]
        assert read_target_info(target).layer_types == ("linear_attention",) * 3 + ("full_attention",)
        raw, names = target_config(target), set(tensor_inventory(target))
        assert "mtp.fc.weight" in names and "mtp.layers.0.self_attn.q_proj.weight" in names
        if family == "qwen3_next":
            assert raw["mtp_num_hidden_layers"] == 1 and "model.embed_tokens.weight" in names
        else:  # composite: the language model under model.language_model, the MTP count under text_config
            assert raw["model_type"] == family and raw["text_config"]["mtp_num_hidden_layers"] == 1
            assert "mtp_num_hidden_layers" not in raw and "model.language_model.embed_tokens.weight" in names
            moe = family == "qwen3_5_moe"
            assert ("mtp.layers.0.mlp.experts.gate_up_proj" in names) is moe
            assert ("mtp.layers.0.mlp.gate_proj.weight" in names) is not moe
        report = validate(config("torch", target))
        assert report.drafter is not None and report.drafter.extra["config"].attn_output_gate


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_plain_on_torch(pairs, torch_plain, torch_spec, family):
    pair = pairs[family]
    plain = torch_plain(family)
    assert plain == transformers_greedy(pair["target"], pair["prompt"], NEW_TOKENS)
    report = validate(config("torch", pair["target"]))
    assert report.ok, [str(p) for p in report.errors]
    result = torch_spec(family)
    assert result.token_ids == plain
    lengths = result.stats.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) == BLOCK, lengths  # rejections and full blocks
    assert 0 < result.stats.per_position_acceptance[0] < 1, result.stats.per_position_acceptance


@pytest.mark.mlx
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_plain_on_mlx(pairs, torch_plain, torch_spec, family):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    pair = pairs[family]
    report = validate(config("mlx", pair["target"]))
    assert report.problems == [], [str(p) for p in report.problems]  # mlx-lm drops the mtp.* tensors itself
    plain = engine("mlx", pair["target"], drafter=False).run(prompt_ids=pair["prompt"], max_new_tokens=NEW_TOKENS,
                                                              ignore_eos=True).token_ids
    assert plain == torch_plain(family)
    result = engine("mlx", pair["target"]).run(prompt_ids=pair["prompt"], max_new_tokens=NEW_TOKENS,
                                                ignore_eos=True, block_size=BLOCK)
    assert result.token_ids == plain
    lengths = result.stats.acceptance_lengths
    assert min(lengths) == 1 and max(lengths) == BLOCK, lengths
    assert lengths == torch_spec(family).stats.acceptance_lengths  # the MTP drafts agree across backends


# -- the MTP head's KV cache through rollbacks ------------------------------------------------------
def fresh_drafter(fresh, committed):
    """A drafter prefilled from scratch with the committed sequence (its last token is the anchor)."""
    capture = fresh.drafter.info.capture
    fresh.target.reset()
    out = fresh.target.prefill(committed[:-1], capture)
    fresh.drafter.prefill(committed[:-1], out, committed[-1])
    return fresh.drafter


def mtp_cycles(live, fresh, prompt, cycles=24, seed=0):
    """Greedy draft/verify/commit cycles by hand with a random draft length; before each, compare
    the live drafter's sampled 3-step proposal (tokens and dense q of every step) with a fresh
    drafter's. Returns (largest q difference, accepted drafts, rejected drafts)."""
    target, drafter, ops, verifier = live.target, live.drafter, live.backend.ops, live.verifier
    # a high temperature flattens the planted head's peaked logits, so q shows what the MTP cache changes
    capture, greedy, soft = drafter.info.capture, SamplingParams(), SamplingParams(temperature=30.0)
    rng = np.random.default_rng(seed)
    out = target.prefill(prompt, capture)
    first = int(ops.to_list(ops.argmax(out.logits[-1:]))[0])
    drafter.prefill(prompt, out, first)
    committed, accepted, rejected, worst = list(prompt) + [first], 0, 0, 0.0
    for step, k in enumerate(rng.integers(1, 4, size=cycles)):
        position = len(committed) - 1
        reference = fresh_drafter(fresh, committed)
        mine = drafter.propose(DraftRequest(committed[-1], position, 3, soft, np.random.default_rng(step)))
        theirs = reference.propose(DraftRequest(committed[-1], position, 3, soft, np.random.default_rng(step)))
        worst = max(worst, float((mine.draft_probs - theirs.draft_probs).abs().max()))
        draft = drafter.propose(DraftRequest(committed[-1], position, int(k), greedy))
        block = ops.concatenate([live.backend.int_array([committed[-1]]), draft.token_ids])
        result = target.forward(block, capture)
        verification = verifier.verify(ops, draft, result.logits, greedy, rng)
        committed += verification.token_ids
        target.reset()  # roll the target back by re-running the committed tokens
        target.prefill(committed[:-1], Capture())
        drafter.commit(result, verification.accepted + 1, verification.token_ids)
        accepted += verification.accepted
        rejected += int(k) - verification.accepted
    return worst, accepted, rejected


@pytest.fixture(scope="module")
def cache_engines(pairs):
    target = pairs["qwen3_5"]["target"]
    return engine("torch", target, sample_drafts=True), engine("torch", target, sample_drafts=True)


def test_mtp_cache_matches_a_fresh_prefill_after_rollbacks(pairs, cache_engines):
    live, fresh = cache_engines
    worst, accepted, rejected = mtp_cycles(live, fresh, pairs["qwen3_5"]["prompt"])
    assert accepted >= 6 and rejected >= 6, (accepted, rejected)
    assert worst < 1e-5
    assert live.drafter.cache_lengths == [live.drafter.committed_length]


def test_mtp_cache_check_fails_when_the_cache_is_not_cropped(pairs, cache_engines, monkeypatch):
    live, fresh = cache_engines
    monkeypatch.setattr(live.drafter.net, "crop", lambda layer, length: None)
    worst, _, rejected = mtp_cycles(live, fresh, pairs["qwen3_5"]["prompt"], cycles=12)
    assert rejected and worst > 1e-4


@pytest.mark.mlx
def test_seeded_sampling_with_sampled_drafts_matches_torch(pairs):
    """Sampled MTP drafts (dense q) verified by speculative sampling on the hybrid Qwen3.5 target:
    one seed gives the same tokens and cycles on both backends, rejections included."""
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    pair = pairs["qwen3_5"]
    kwargs = dict(prompt_ids=pair["prompt"], max_new_tokens=NEW_TOKENS, ignore_eos=True, block_size=BLOCK,
                  temperature=1.0, top_p=0.95, seed=7)
    runs = {kind: engine(kind, pair["target"], sample_drafts=True).run(**kwargs) for kind in ("torch", "mlx")}
    assert runs["mlx"].token_ids == runs["torch"].token_ids
    lengths = runs["torch"].stats.acceptance_lengths
    assert runs["mlx"].stats.acceptance_lengths == lengths
    assert min(lengths) == 1 and max(lengths) > 1, lengths
