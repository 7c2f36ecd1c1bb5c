"""MTP drafting through the engine: index alignment, drafter-cache consistency after accepts
and rejects, and greedy losslessness (PyTorch, CPU, float32)."""

from __future__ import annotations

import numpy as np
import pytest

import speculant
from speculant.core.types import DraftRequest, SamplingParams
from speculant.testing.tiny_mtp import bigram_mtp, build_bigram_target, build_tiny_mtp, copy_target, mtp_tensors, write_mtp

pytest.importorskip("torch")


def engine(target, drafter=True, **options):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if drafter:
        config["drafter"] = {"kind": "mtp", "options": options}
    return speculant.load_engine(config)


_LOADED: dict = {}


def shared_engine(target, **options):
    """One loaded engine per (folder, options) for the tests that only call ``run``."""
    key = (str(target), tuple(sorted(options.items())))
    if key not in _LOADED:
        _LOADED[key] = engine(target, **options)
    return _LOADED[key]


@pytest.fixture(scope="module")
def exact(tmp_path_factory, torch_threads):
    """A bigram target (next token = f(current) on a 32-token cycle) and its cycle."""
    target, cycle = build_bigram_target(tmp_path_factory.mktemp("mtp_exact") / "target", layer_scale=1e-3)
    return target, cycle


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, torch_threads):
    """A bigram target with stronger context-dependent layers, and MTPs whose drafts are accepted
    about half the time (token-path bigram MTP, random full-scale blocks)."""
    root = tmp_path_factory.mktemp("mtp_mixed")
    base, cycle = build_bigram_target(root / "base", layer_scale=0.1)
    out = {"cycle": cycle, "plain": engine(base, drafter=False)}
    for layout, layers in (("qwen", 1), ("deepseek", 2)):
        target = copy_target(base, root / f"{layout}{layers}")
        canonical = bigram_mtp(target, cycle, path="token", num_layers=layers, block_scale=1.0, seed=3)
        write_mtp(target, mtp_tensors(canonical, layout, 4), layout, layers)
        out[f"{layout}{layers}"] = target
    return out


@pytest.fixture(scope="module")
def rejecting(tmp_path_factory, torch_threads):
    """A planted random target and random MTP layers (drafts almost never accepted)."""
    from speculant.testing.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("mtp_reject")
    base = build_tiny_target(root / "base", seed=0, planted=6.0)
    out = {"plain": engine(base, drafter=False)}
    for layout, layers in (("qwen", 2), ("deepseek", 1)):
        target = copy_target(base, root / f"{layout}{layers}")
        build_tiny_mtp(target, layout=layout, num_layers=layers, seed=9)
        out[f"{layout}{layers}"] = target
    return out


# -- index alignment -------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,layers", [("qwen", 1), ("deepseek", 1), ("qwen", 2), ("deepseek", 2)])
@pytest.mark.parametrize("path", ["token", "hidden"])
def test_exact_mtp_is_always_accepted(exact, tmp_path, layout, layers, path):
    base, cycle = exact
    plain = engine(base, drafter=False).run(prompt_ids=cycle[:5], max_new_tokens=30, ignore_eos=True).token_ids
    assert plain == [cycle[(5 + i) % len(cycle)] for i in range(30)], "the bigram target follows its cycle"
    target = copy_target(base, tmp_path / "target")
    write_mtp(target, mtp_tensors(bigram_mtp(target, cycle, path=path, num_layers=layers), layout, 4), layout, layers)
    spec = engine(target)
    for k in (1, 2, 3):
        result = spec.run(prompt_ids=cycle[:5], max_new_tokens=30, ignore_eos=True, block_size=k + 1)
        assert result.token_ids == plain
        assert result.stats.per_position_acceptance == [1.0] * k
        assert all(a == k + 1 for a in result.stats.acceptance_lengths[:-1])


@pytest.mark.parametrize("path,shift", [("token", -1), ("token", 1), ("hidden", 0), ("hidden", 2)])
def test_off_by_one_mtp_is_never_accepted(exact, tmp_path, path, shift):
    """The same construction one step short or long: the alignment test has power."""
    base, cycle = exact
    target = copy_target(base, tmp_path / "target")
    write_mtp(target, mtp_tensors(bigram_mtp(target, cycle, path=path, shift=shift), "qwen"), "qwen", 1)
    result = engine(target).run(prompt_ids=cycle[:5], max_new_tokens=30, ignore_eos=True, block_size=3)
    assert result.stats.per_position_acceptance == [0.0, 0.0]


# -- drafter-cache consistency ---------------------------------------------------------------------
def committed_fresh(fresh, committed):
    """A freshly prefilled drafter for the committed sequence (its last token is the anchor)."""
    capture = fresh.drafter.info.capture
    fresh.target.reset()
    out = fresh.target.prefill(committed[:-1], capture)
    fresh.drafter.prefill(committed[:-1], out, committed[-1])
    return fresh.drafter


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory, torch_threads):
    """A random target and random MTP layers at full scale: attention over the MTP cache moves q."""
    from speculant.testing.tiny import build_tiny_target

    root = tmp_path_factory.mktemp("mtp_random")
    base = build_tiny_target(root / "base", seed=1)
    out = {}
    for layout, layers in (("qwen", 1), ("deepseek", 2)):
        target = copy_target(base, root / f"{layout}{layers}")
        build_tiny_mtp(target, layout=layout, num_layers=layers, seed=4)
        out[f"{layout}{layers}"] = target
    return out


def check_cache_consistency(target_path, prompt, sampling, steps=30, seed=0, power=False):
    """Run draft/verify/commit cycles by hand with a random k per cycle (0 = plain step); before
    every cycle, the live drafter must hold one MTP entry per committed position and layer, and
    propose exactly what a fresh drafter prefilled with the committed sequence proposes. With
    ``power``, also show that q is sensitive to the MTP cache (the bigram MTP's q is nearly one-hot
    and hardly depends on it, so its check relies on the random pair's)."""
    live, fresh = engine(target_path, sample_drafts=True), engine(target_path, sample_drafts=True)
    target, drafter, ops, verifier = live.target, live.drafter, live.backend.ops, live.verifier
    capture, layers = drafter.info.capture, drafter.cfg.num_layers
    rng = np.random.default_rng(seed)
    out = target.prefill(prompt, capture)
    first = verifier.verify(ops, None, out.logits[-1:], sampling, rng).token_ids[0]
    drafter.prefill(prompt, out, first)
    committed = list(prompt) + [first]
    accepted_total = rejected_total = 0
    soft = SamplingParams(temperature=1.0)
    for step, k in enumerate(rng.integers(0, 5, size=steps)):
        position = len(committed) - 1
        assert drafter.cache_lengths == [max(0, position - j) for j in range(layers)]
        reference = committed_fresh(fresh, committed)
        for kk in (1, 4):  # a sampled draft's dense q exposes the whole distribution of every step
            mine = drafter.propose(DraftRequest(committed[-1], position, kk, soft, np.random.default_rng(step)))
            theirs = reference.propose(DraftRequest(committed[-1], position, kk, soft, np.random.default_rng(step)))
            assert mine.token_ids.tolist() == theirs.token_ids.tolist()
            np.testing.assert_allclose(mine.draft_probs.numpy(), theirs.draft_probs.numpy(), atol=2e-5, rtol=0)
        if power and step == 3:  # one different early token gives a clearly different q
            other = committed_fresh(fresh, [committed[0] + 1] + committed[1:])
            q_other = other.propose(DraftRequest(committed[-1], position, 4, soft, np.random.default_rng(step))).draft_probs
            assert (q_other - mine.draft_probs).abs().max() > 1e-3
        draft = None
        block = live.backend.int_array([committed[-1]])
        if k:
            draft = drafter.propose(DraftRequest(committed[-1], position, int(k), sampling, np.random.default_rng(1000 + step)))
            again = committed_fresh(fresh, committed).propose(
                DraftRequest(committed[-1], position, int(k), sampling, np.random.default_rng(1000 + step)))
            assert draft.token_ids.tolist() == again.token_ids.tolist()
            block = ops.concatenate([block, draft.token_ids])
        result = target.forward(block, capture)
        verification = verifier.verify(ops, draft, result.logits, sampling, rng)
        target.crop(position + verification.accepted + 1)
        drafter.commit(result, verification.accepted + 1, verification.token_ids)
        committed += verification.token_ids
        accepted_total += verification.accepted
        rejected_total += int(k) - verification.accepted
    return committed, accepted_total, rejected_total


@pytest.mark.parametrize("name", ["qwen1", "deepseek2"])
def test_drafter_cache_matches_a_fresh_prefill_greedy(mixed, name):
    prompt = mixed["cycle"][:6]
    committed, accepted, rejected = check_cache_consistency(mixed[name], prompt, SamplingParams())
    assert accepted >= 8 and rejected >= 8, (accepted, rejected)
    plain = mixed["plain"].run(prompt_ids=prompt, max_new_tokens=len(committed) - len(prompt), ignore_eos=True)
    assert committed[len(prompt):] == plain.token_ids


@pytest.mark.parametrize("name", ["qwen1", "deepseek2"])
def test_drafter_cache_matches_a_fresh_prefill_sampled(random_pair, name):
    _, accepted, rejected = check_cache_consistency(random_pair[name], [5, 6, 7, 8], SamplingParams(temperature=1.0), power=True)
    assert accepted >= 3 and rejected >= 3, (accepted, rejected)


def test_propose_out_of_step_is_an_error(mixed):
    live = shared_engine(mixed["qwen1"])
    live.run(prompt_ids=mixed["cycle"][:4], max_new_tokens=3, ignore_eos=True)
    with pytest.raises(RuntimeError, match="out of step"):
        live.drafter.propose(DraftRequest(0, 1, 2))


# -- greedy losslessness ---------------------------------------------------------------------------
PROMPTS = {"one_token": 1, "seven": 7, "near_max_context": 500}


def prompt_of(cycle, length):
    rng = np.random.default_rng(length)
    return [int(t) for t in rng.choice(cycle + list(range(20, 60)), size=length)]


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("name", ["qwen1", "deepseek2"])
def test_greedy_equals_plain_with_partial_acceptance(mixed, name, k, prompt):
    ids = prompt_of(mixed["cycle"], PROMPTS[prompt])
    expected = mixed["plain"].run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True)
    result = shared_engine(mixed[name]).run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True, block_size=k + 1)
    assert result.token_ids == expected.token_ids
    assert result.stats.stop_reason == expected.stats.stop_reason
    assert result.stats.new_tokens == 1 + sum(result.stats.acceptance_lengths)
    if prompt != "near_max_context":
        assert 0 < sum(result.stats.acceptance_lengths) - len(result.stats.acceptance_lengths) < 39


@pytest.mark.parametrize("name", ["qwen2", "deepseek1"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_plain_when_everything_is_rejected(rejecting, name, k):
    expected = rejecting["plain"].run(prompt_ids=[9, 8, 7], max_new_tokens=30, ignore_eos=True).token_ids
    result = shared_engine(rejecting[name]).run(prompt_ids=[9, 8, 7], max_new_tokens=30, ignore_eos=True, block_size=k + 1)
    assert result.token_ids == expected


def test_stop_token_inside_a_block(mixed):
    ids = prompt_of(mixed["cycle"], 7)
    reference = mixed["plain"].run(prompt_ids=ids, max_new_tokens=40, ignore_eos=True).token_ids
    stop = next(t for i, t in enumerate(reference) if i >= 4 and t not in reference[:i])
    cut = reference.index(stop) + 1
    spec = shared_engine(mixed["deepseek2"])
    for block in (2, 3, 5):
        result = spec.run(prompt_ids=ids, max_new_tokens=40, block_size=block, stop_token_ids=[stop], ignore_eos=True)
        assert result.token_ids == reference[:cut] and result.stats.stop_reason == "eos"


def test_hidden_tap_choice_is_still_lossless(mixed):
    ids = prompt_of(mixed["cycle"], 7)
    expected = mixed["plain"].run(prompt_ids=ids, max_new_tokens=30, ignore_eos=True).token_ids
    for options in ({"hidden_tap": "pre_norm"}, {"recycle_hidden": "pre_norm"}):
        result = engine(mixed["qwen1"], **options).run(prompt_ids=ids, max_new_tokens=30, ignore_eos=True, block_size=3)
        assert result.token_ids == expected
