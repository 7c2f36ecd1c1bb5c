"""Greedy speculative output equals plain greedy decoding, token for token (PyTorch, float32)."""

from __future__ import annotations

import pytest

import speculant

PROMPTS = {
    "one_token": [5],
    "short": [5, 6, 7],
    "longer_than_window": list(range(20, 52)),  # 32 tokens > the sliding draft's window of 8
}


def engine(target, draft=None, **drafter):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if draft is not None:
        config["drafter"] = {"kind": "dflash", "path": str(draft), **drafter}
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def engines(planted_pair):
    return {
        "plain": engine(planted_pair["target"]),
        "dflash": engine(planted_pair["target"], planted_pair["draft"]),
        "dflash_swa": engine(planted_pair["target"], planted_pair["draft_swa"]),
    }


def plain_tokens(engines, prompt, n, **kw):
    return engines["plain"].run(prompt_ids=prompt, max_new_tokens=n, **kw).token_ids


@pytest.mark.parametrize("prompt", list(PROMPTS), ids=list(PROMPTS))
@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("drafter", ["dflash", "dflash_swa"])
def test_greedy_equals_plain(engines, prompt, block_size, drafter):
    ids = PROMPTS[prompt]
    expected = plain_tokens(engines, ids, 40, ignore_eos=True)
    result = engines[drafter].run(prompt_ids=ids, max_new_tokens=40, block_size=block_size, ignore_eos=True)
    assert result.token_ids == expected
    stats = result.stats
    assert stats.new_tokens == 40 == 1 + sum(stats.acceptance_lengths)
    assert all(1 <= a <= block_size for a in stats.acceptance_lengths)
    assert stats.verify_steps == len(stats.acceptance_lengths)
    assert stats.stop_reason == "max_new_tokens"


def test_planted_pair_accepts_several_tokens(engines):
    result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=60, block_size=8, ignore_eos=True)
    assert result.stats.mean_acceptance_length > 1.5
    assert max(result.stats.acceptance_lengths) >= 3
    assert result.stats.per_position_acceptance[0] > 0.3


@pytest.mark.parametrize("max_new", [1, 2, 5, 13, 31])
def test_max_new_tokens_inside_a_block(engines, max_new):
    expected = plain_tokens(engines, PROMPTS["short"], max_new, ignore_eos=True)
    result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=max_new, block_size=8, ignore_eos=True)
    assert result.token_ids == expected and len(expected) == max_new
    assert result.stats.new_tokens == 1 + sum(result.stats.acceptance_lengths)


def test_stop_token_inside_a_block(engines):
    reference = plain_tokens(engines, PROMPTS["short"], 40, ignore_eos=True)
    # a stop id whose first occurrence lies inside the run, so it lands mid-block
    stop = next(t for i, t in enumerate(reference) if i >= 4 and t not in reference[:i])
    cut = reference.index(stop) + 1
    for block in (4, 8, 16):
        result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=block,
                                       stop_token_ids=[stop], ignore_eos=True)
        assert result.token_ids == reference[:cut]
        assert result.stats.stop_reason == "eos"
        assert result.stats.new_tokens == cut


def test_eos_from_target_config_stops(engines, planted_pair):
    eos = engines["plain"].target.info.eos_token_ids
    assert eos, "the tiny target declares an EOS id"
    result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=8)
    tokens = result.token_ids
    plain = plain_tokens(engines, PROMPTS["short"], 40)
    assert tokens == plain
    assert not any(t in eos for t in tokens[:-1])


def test_random_draft_still_lossless(random_pair):
    plain = engine(random_pair["target"]).run(prompt_ids=[9, 8, 7], max_new_tokens=30, ignore_eos=True)
    spec = engine(random_pair["target"], random_pair["draft"]).run(prompt_ids=[9, 8, 7], max_new_tokens=30, ignore_eos=True)
    assert spec.token_ids == plain.token_ids


def test_decoding_passes_the_cache_under_the_name_transformers_expects(engines):
    """Newer transformers renamed the forward's ``past_key_values`` to ``cache`` and warn on every
    call with the old name; the warning would land in every ``speculant generate``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=12, block_size=4, ignore_eos=True)
    assert len(result.token_ids) == 12
