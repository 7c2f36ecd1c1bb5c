"""``engine.session()``: a multi-turn conversation whose later turns resume from the prefix
cache, with the tokens a cold request gives; and ``engine.generate`` reusing an earlier prompt."""

from __future__ import annotations

import pytest

import speculant
from speculant.core.errors import SettingError

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
BACKEND = {"kind": "torch", "device": "cpu", "dtype": "float32"}


@pytest.fixture(scope="module")
def engine(tiny_target):
    return speculant.load_engine({"backend": BACKEND, "target": {"path": str(tiny_target)}})


def cold_ids(engine, ids, new):
    engine.prefix_store.clear()
    result = engine.run(prompt_ids=ids, max_new_tokens=new, ignore_eos=True)
    assert result.stats.cached_tokens == 0
    return result.token_ids


def test_a_conversation_of_token_ids_resumes_each_turn_at_the_last_output(engine):
    engine.prefix_store.clear()
    session = engine.session()
    first = session.extend([5, 6, 7, 8, 9, 10, 11, 12], max_new_tokens=16, ignore_eos=True)
    assert first.stats.cached_tokens == 0
    history = list(session.token_ids)
    second = session.extend([40, 41, 42], max_new_tokens=32, ignore_eos=True)
    assert second.stats.cached_tokens == len(history) - 1  # all but the last output token
    assert session.token_ids == history + [40, 41, 42] + second.token_ids
    assert second.token_ids == cold_ids(engine, history + [40, 41, 42], 32)


def test_chat_turns_resume_from_the_cache_with_cold_tokens(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATE, raising=False)
    engine.prefix_store.clear()
    session = engine.session(system="be brief")
    session.say("hello there", max_new_tokens=12, ignore_eos=True)
    second = session.say("and then?", max_new_tokens=24, ignore_eos=True)
    assert second.stats.cached_tokens > 0
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    rendered = engine.tokenizer.apply_chat_template(session.messages[:4], add_generation_prompt=True, tokenize=False)
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert second.token_ids == cold_ids(engine, ids, 24)
    assert session.messages[-1]["content"] == second.text


def test_a_session_without_a_chat_template_says_how_to_hold_ids(engine, monkeypatch):
    monkeypatch.setattr(engine.tokenizer, "chat_template", None, raising=False)
    with pytest.raises(SettingError, match="no chat template.*session.extend"):
        engine.session().say("hi")


def test_generate_reuses_an_earlier_prompt_and_the_stats_say_so(engine):
    engine.prefix_store.clear()
    engine.run(prompt_ids=list(range(5, 40)), max_new_tokens=4)
    with engine.generate(prompt_ids=list(range(5, 50)), max_new_tokens=4) as generation:
        chunks = list(generation)
    stats = chunks[-1].stats
    assert stats.cached_tokens == 35 and "35 of 45 prompt tokens from the prefix cache" in str(stats)
    assert stats.as_dict()["cached_tokens"] == 35
    assert stats.as_dict()["prefix_cache_hits"] == engine.prefix_store.stats.hits >= 1
    assert stats.as_dict()["prefix_cache_bytes"] > 0 and "hits," in str(stats)
    assert engine.prefix_store.stats.hits >= 1 and engine.prefix_store.bytes > 0
