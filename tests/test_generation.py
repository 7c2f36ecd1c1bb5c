"""What a caller gets back from one request without reading engine state: the last chunk's
stop reason and stats, and the Generation's own record (also when closed early)."""

from __future__ import annotations

import pytest

import speculant


@pytest.fixture(scope="module")
def spec(planted_pair):
    return speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                  "target": {"path": str(planted_pair["target"])},
                                  "drafter": {"kind": "dflash", "path": str(planted_pair["draft"])}})


def test_the_last_chunk_carries_the_stop_reason_and_the_stats(spec):
    chunks = list(spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=12, ignore_eos=True))
    last = chunks[-1]
    assert last.stop_reason == "max_new_tokens" and last.stats.stop_reason == "max_new_tokens"
    assert last.stats.new_tokens == 12 == sum(len(c.token_ids) for c in chunks)
    assert all(c.stop_reason is None and c.stats is None for c in chunks[:-1])


def test_each_generation_keeps_its_own_record(spec):
    first = spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=9, ignore_eos=True)
    first_ids = [t for c in first for t in c.token_ids]
    second = spec.generate(prompt_ids=[8, 9], max_new_tokens=5, ignore_eos=True)
    list(second)
    assert first.token_ids == first_ids and len(first_ids) == 9 and first.stats.new_tokens == 9
    assert second.stats.new_tokens == 5 and first.stats is not second.stats
    assert spec.last_stats is second.stats  # the engine's copy is only the latest request's


def test_closing_early_keeps_what_was_produced(spec):
    generation = spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
    produced = list(next(generation).token_ids)
    generation.close()
    assert generation.token_ids == produced and generation.stats.stop_reason == "interrupted"
    assert generation.stats.new_tokens == len(produced)
    assert spec.run(prompt_ids=[5], max_new_tokens=3, ignore_eos=True).stats.new_tokens == 3  # engine free


def test_a_stop_string_is_the_last_chunks_reason(spec):
    text = spec.run(prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True).text
    stop = text[10:13]
    chunks = list(spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True, stop_strings=[stop]))
    assert chunks[-1].stop_reason == "stop_string"
    assert "".join(c.text for c in chunks) == text[:text.find(stop)]
