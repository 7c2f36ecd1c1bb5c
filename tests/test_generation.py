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


# -- ending a request from outside it (issue 37) ----------------------------------------------
def test_an_exception_in_the_callers_loop_body_frees_the_engine_with_a_with_block(spec):
    with pytest.raises(KeyboardInterrupt):
        with spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True) as generation:
            for _ in generation:
                raise KeyboardInterrupt  # Ctrl-C landing in the caller's own code
    assert generation.stats.stop_reason == "interrupted" and generation.token_ids
    assert spec.run(prompt_ids=[5], max_new_tokens=3, ignore_eos=True).stats.new_tokens == 3


def test_ctrl_c_between_chunks_of_run_frees_the_engine_though_a_traceback_is_kept(spec):
    """A REPL keeps the last traceback, and with it run()'s frame; the request must not stay open."""
    import sys

    lines = 0

    def interrupt_in_runs_own_code(frame, event, arg):
        nonlocal lines
        if event == "line" and frame.f_code.co_name == "<genexpr>" and frame.f_code.co_filename.endswith("engine.py"):
            lines += 1
            if lines == 3:
                raise KeyboardInterrupt
        return interrupt_in_runs_own_code

    sys.settrace(lambda frame, event, arg: interrupt_in_runs_own_code)
    try:
        spec.run(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
    except KeyboardInterrupt as exc:
        kept = exc  # noqa: F841  (holds the traceback, as sys.last_exc would)
    finally:
        sys.settrace(None)
    assert lines >= 3
    assert spec.run(prompt_ids=[5], max_new_tokens=3, ignore_eos=True).stats.new_tokens == 3


def test_cancel_from_another_thread_keeps_what_was_produced(spec):
    import threading

    reference = spec.run(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True).token_ids
    generation = spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
    first = list(next(generation).token_ids)
    returned: list = []
    canceller = threading.Thread(target=lambda: returned.append(generation.cancel()))
    canceller.start()
    canceller.join(30)
    assert returned == [first]  # the stream was waiting: cancelled at once, nothing more produced
    assert spec.run(prompt_ids=[5], max_new_tokens=3, ignore_eos=True).stats.new_tokens == 3  # engine free
    rest = list(generation)
    assert [c.stop_reason for c in rest] == ["cancelled"] and rest[-1].stats.new_tokens == len(first)
    assert generation.token_ids == first == reference[:len(first)]
    assert generation.cancel() == first  # once ended, cancel does nothing


def test_cancel_while_another_thread_iterates(spec):
    import threading
    import time

    reference = spec.run(prompt_ids=[5, 6, 7], max_new_tokens=200, ignore_eos=True).token_ids
    generation = spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=200, ignore_eos=True)
    started, chunks = threading.Event(), []

    def consume() -> None:
        for chunk in generation:
            chunks.append(chunk)
            started.set()
            time.sleep(0.05)  # a slow reader: 200 tokens take seconds, so cancel lands mid-stream

    consumer = threading.Thread(target=consume)
    consumer.start()
    started.wait(30)
    ids = generation.cancel()
    consumer.join(30)
    assert not consumer.is_alive() and chunks[-1].stop_reason == "cancelled"
    assert ids == generation.token_ids == [t for c in chunks for t in c.token_ids] == reference[:len(ids)]
    assert len(ids) < 200


def test_cancel_before_the_first_chunk_ends_before_the_prefill(spec):
    generation = spec.generate(prompt_ids=[5, 6, 7], max_new_tokens=10, ignore_eos=True)
    assert generation.cancel() == []
    [last] = list(generation)
    assert last.stop_reason == "cancelled" and last.stats.new_tokens == 0


def test_block_size_for_an_engine_without_a_drafter_warns(planted_pair):
    plain = speculant.load_engine({"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"},
                                   "target": {"path": str(planted_pair["target"])}})
    with pytest.warns(UserWarning, match=r"block_size=4.*no drafter"):
        result = plain.run(prompt_ids=[5, 6], max_new_tokens=3, block_size=4)
    assert result.stats.new_tokens == 3


def test_stop_token_ids_outside_the_vocabulary_name_the_id_and_the_size(spec):
    from speculant.core.errors import SettingError

    vocab = spec.target.info.vocab_size
    with pytest.raises(SettingError) as info:
        spec.run(prompt_ids=[5, 6], max_new_tokens=3, stop_token_ids=[1, vocab])
    assert f"token id {vocab}" in str(info.value) and f"vocab size {vocab}" in str(info.value)
    assert info.value.field == "generation.stop_token_ids"
