"""Speculative decoding of the real SmolLM2-135M-Instruct target is lossless on PyTorch and MLX:
greedy output equals plain greedy over 128 new tokens on several chat prompts, and the first
sampled tokens at temperature 0.8 follow the target's distribution (chi-square). The drafters are
untrained (random) DFlash2 and DFlash networks of the target's shape, with prompt lookup on, so
both rejected model drafts and accepted copies pass through the verifier.

About 10 minutes on two busy cores: marked ``slow`` and ``real_pair``."""

from __future__ import annotations

import pytest

import speculant
from real_pair_helpers import random_drafters, smollm2

pytestmark = [pytest.mark.slow, pytest.mark.real_pair]

PROMPTS = ["Write a Python function that adds two numbers.", "List the numbers from 1 to 40, one per line.",
           "Explain briefly what a dictionary is in Python."]
NEW_TOKENS = 128
BLOCK = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = smollm2()[2]
    return target, random_drafters(tmp_path_factory.mktemp("smollm2-drafters"), target, BLOCK)


def load(backend: str, target, drafter: str | None = None, path=None, lookup: bool = True):
    config = {"backend": {"kind": backend, "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}}
    if drafter:
        config["drafter"] = {"kind": drafter, "path": str(path), "lookup": {"enabled": lookup}}
    return speculant.load_engine(config)


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)


def greedy_identity(backend: str, pair, runs: list[tuple[str, bool, int]]) -> None:
    """``runs``: (drafter kind, lookup on, prompt index); each compared with plain greedy."""
    target, drafters = pair
    engines = {(kind, lookup): load(backend, target, kind, drafters[kind], lookup) for kind, lookup, _ in runs}
    plain = next(iter(engines.values())).without_drafter()
    expected: dict[int, list[int]] = {}
    for kind, lookup, index in runs:
        prompt = chat(plain, PROMPTS[index])
        if index not in expected:
            expected[index] = plain.run(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids
        result = engines[(kind, lookup)].run(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert result.token_ids == expected[index], (backend, kind, lookup, PROMPTS[index])
        assert result.stats.new_tokens == NEW_TOKENS == 1 + sum(result.stats.acceptance_lengths)
    readable = plain.tokenizer.decode(expected[0])
    assert "def " in readable and "return" in readable, readable  # a real model answering, not noise


def test_greedy_identity_torch(pair, torch_threads):
    greedy_identity("torch", pair, [("dflash2", True, 0), ("dflash2", True, 1), ("dflash2", True, 2),
                                    ("dflash", False, 0)])


def test_greedy_identity_mlx(pair):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    # two prompts, one per drafter: a verify block costs MLX on a CPU several plain steps
    greedy_identity("mlx", pair, [("dflash2", True, 1), ("dflash", True, 0)])


def test_first_sampled_tokens_follow_the_target_at_temperature_0_8(pair, torch_threads):
    from speculant.check import check_sampling
    from speculant.core.types import SamplingParams

    target, drafters = pair
    engine = load("torch", target, "dflash2", drafters["dflash2"], lookup=False)
    result = check_sampling(engine, chat(engine, "Name a colour."), samples=200,
                            sampling=SamplingParams(temperature=0.8), tokens=2)
    assert result.per_position.get(1), "no second-token group was large enough to test the verifier"
    assert result.ok, result
