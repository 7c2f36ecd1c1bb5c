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

pytestmark = [pytest.mark.slow, pytest.mark.real_pair, pytest.mark.remembered_timings]

PROMPTS = ["Write a Python function that adds two numbers.", "List the numbers from 1 to 40, one per line.",
           "Explain briefly what a dictionary is in Python."]
NEW_TOKENS = 128
BLOCK = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The target and its random drafters. The layouts of their weights are timed at the first load
    of each backend and read back by the later ones (``remembered_timings``), as a user's loads are."""
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


def test_serve_answers_chat_through_the_openai_client_as_plain_decoding_does(pair, torch_threads):
    """`speculant serve` on the real pair (speculative: DFlash2 + lookup) answers the official
    openai client's chat.completions, whole and streamed, with the target's plain greedy text."""
    openai = pytest.importorskip("openai")
    from speculant.serve import create_app
    from speculant.serve.background import serving

    target, drafters = pair
    plain = load("torch", target)
    expected = plain.run(prompt_ids=chat(plain, PROMPTS[2]), max_new_tokens=48, temperature=0)
    assert len(expected.text.split()) > 5  # a real answer, not an empty or one-token reply
    engine = load("torch", target, "dflash2", drafters["dflash2"], lookup=True)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    with serving(create_app(engine, max_queue=4, timeout=300)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=300, max_retries=0)
        whole = client.chat.completions.create(model="speculant", messages=messages, max_completion_tokens=48,
                                               temperature=0)
        events = list(client.chat.completions.create(model="speculant", messages=messages, max_tokens=48,
                                                     temperature=0, stream=True))
    streamed = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert whole.choices[0].message.content == expected.text == streamed
    assert whole.usage.completion_tokens == len(expected.token_ids)


def test_load_pair_chats_with_smollm2_and_batches_chats_as_each_alone(pair, monkeypatch, torch_threads):
    """From Python as from the command line: ``speculant.load_pair()`` is SmolLM2 with prompt lookup,
    and ``engine.chat_ids`` renders chat messages for ``run_many``, whose greedy answers equal each
    chat's own ``run``."""
    target = pair[0]
    monkeypatch.delenv("SPECULANT_PAIR", raising=False)  # the tests' default is tiny
    monkeypatch.setenv("SPECULANT_HOME", str(target.parents[1]))
    engine = speculant.load_pair(backend="torch")
    assert engine.config.target.path == target
    assert engine.config.drafter.lookup.enabled and not engine.config.drafter.enabled
    french = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}]
    prompts = [engine.chat_ids(text) for text in PROMPTS] + [engine.chat_ids(french)]
    assert prompts[0] == chat(engine, PROMPTS[0]) and prompts[3] != engine.chat_ids(french[1:])
    together = engine.run_many(prompt_ids=prompts, max_new_tokens=24)
    assert [r.token_ids for r in together] == [engine.run(prompt_ids=p, max_new_tokens=24).token_ids for p in prompts]
    assert "def " in together[0].text, together[0].text


def test_the_readme_run_command_chats_with_smollm2_by_default(pair):
    """README's run command, no config and no --pair: SmolLM2 answers the chat prompt (prompt
    lookup alone, no drafter ships for it yet) with plain decoding's tokens, and says so."""
    import os
    import subprocess
    import sys

    target = pair[0]
    env = {k: v for k, v in os.environ.items() if k != "SPECULANT_PAIR"}  # the tests' default is tiny
    env.update(SPECULANT_HOME=str(target.parents[1]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "speculant", "generate", "--chat", PROMPTS[0], "--compare",
                           "--max-new-tokens", "48"], env=env, capture_output=True, text=True, timeout=600)
    # --compare refuses an engine with neither a drafter nor lookup: its speed-up line shows lookup on
    assert done.returncode == 0, done.stderr
    assert "def " in done.stdout, done.stdout  # a real answer to the prompt
    assert "speed-up" in done.stderr and "identical output: all 48 tokens" in done.stderr, done.stderr
