"""Greedy speculative output equals plain greedy decoding, token for token (MLX, float32).

The same catalogue as tests/test_lossless_torch.py: block sizes 2/4/8/16, prompts of one token,
a few tokens and longer than the sliding draft's window, max-new-tokens and stop tokens that
land inside a block.
"""

from __future__ import annotations

import pytest

import speculant

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

PROMPTS = {
    "one_token": [5],
    "short": [5, 6, 7],
    "longer_than_window": list(range(20, 52)),  # 32 tokens > the sliding draft's window of 8
}


def engine(target, draft=None, **drafter):
    config = {"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
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


def test_engine_runs_on_mlx(engines):
    e = engines["dflash"]
    assert e.backend.name == "mlx" and e.backend.device == "cpu"
    assert type(e.target).__module__ == "speculant.backends.mlx.target"
    assert type(e.drafter.net).__module__ == "speculant.drafters.dflash.mlx"


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
    assert min(result.stats.acceptance_lengths) < 8  # rejections happen too


@pytest.mark.parametrize("max_new", [1, 2, 5, 13, 31])
def test_max_new_tokens_inside_a_block(engines, max_new):
    expected = plain_tokens(engines, PROMPTS["short"], max_new, ignore_eos=True)
    result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=max_new, block_size=8, ignore_eos=True)
    assert result.token_ids == expected and len(expected) == max_new
    assert result.stats.new_tokens == 1 + sum(result.stats.acceptance_lengths)


def test_stop_token_inside_a_block(engines):
    reference = plain_tokens(engines, PROMPTS["short"], 40, ignore_eos=True)
    stop = next(t for i, t in enumerate(reference) if i >= 4 and t not in reference[:i])
    cut = reference.index(stop) + 1
    for block in (4, 8, 16):
        result = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=block,
                                       stop_token_ids=[stop], ignore_eos=True)
        assert result.token_ids == reference[:cut]
        assert result.stats.stop_reason == "eos"
        assert result.stats.new_tokens == cut


def test_eos_from_target_config_stops(engines):
    eos = engines["plain"].target.info.eos_token_ids
    assert eos, "the tiny target declares an EOS id"
    tokens = engines["dflash"].run(prompt_ids=PROMPTS["short"], max_new_tokens=40, block_size=8).token_ids
    assert tokens == plain_tokens(engines, PROMPTS["short"], 40)
    assert not any(t in eos for t in tokens[:-1])


def test_text_prompt_and_streaming(engines):
    chunks = list(engines["dflash"].generate("def add(a, b):", max_new_tokens=24, ignore_eos=True, block_size=8))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == engines["plain"].run("def add(a, b):", max_new_tokens=24, ignore_eos=True).token_ids
    assert "".join(c.text for c in chunks) == engines["dflash"].tokenizer.decode(ids, skip_special_tokens=True)


def test_random_draft_still_lossless(random_pair):
    plain = engine(random_pair["target"]).run(prompt_ids=[9, 8, 7], max_new_tokens=30, ignore_eos=True)
    spec = engine(random_pair["target"], random_pair["draft"]).run(prompt_ids=[9, 8, 7], max_new_tokens=30, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
