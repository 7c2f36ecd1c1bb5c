"""Engine behaviour: streaming, stop strings, interruption, bad logits, context limits, stats."""

from __future__ import annotations

import json

import pytest

import speculant
from speculant.core.errors import ContextTooLongError, NonFiniteLogitsError
from speculant.core.metrics import PUBLIC_FIELDS


def make(target, draft=None, **extra):
    config = {"backend": {"kind": "torch", "device": "cpu", "dtype": "float32"}, "target": {"path": str(target)}, **extra}
    if draft is not None:
        config["drafter"] = {"kind": "dflash", "path": str(draft)}
    return speculant.load_engine(config)


@pytest.fixture(scope="module")
def spec(planted_pair):
    return make(planted_pair["target"], planted_pair["draft"])


@pytest.fixture(scope="module")
def plain(planted_pair):
    return make(planted_pair["target"])


def test_streamed_text_and_ids_add_up(spec):
    chunks = list(spec.generate("def add(a, b):", max_new_tokens=30, ignore_eos=True, block_size=8))
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == spec.last_token_ids and len(ids) == 30
    assert "".join(c.text for c in chunks) == spec.tokenizer.decode(ids, skip_special_tokens=True)


def test_stats_fields(spec):
    spec.run("for i in", max_new_tokens=20, ignore_eos=True)
    stats = spec.last_stats
    data = json.loads(stats.to_json())
    assert tuple(data) == PUBLIC_FIELDS
    assert data["new_tokens"] == 20 and data["stop_reason"] == "max_new_tokens"
    assert data["ttft_s"] > 0 and data["decode_tokens_per_s"] > 0 and data["prefill_tokens_per_s"] > 0
    assert data["total_s"] >= data["ttft_s"]
    assert data["verify_steps"] == len(data["acceptance_lengths"])
    assert len(data["per_position_acceptance"]) == 15  # trained block 16 is the runtime default
    assert data["peak_memory_bytes"] is None or data["peak_memory_bytes"] > 0


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_stop_string_spanning_tokens(spec, plain, block_size):
    reference = plain.run(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True)
    text = reference.text
    # a stop string made of the end of one token's text and the start of the next ones
    pieces = [plain.tokenizer.decode([t]) for t in reference.token_ids]
    start = sum(len(p) for p in pieces[:6]) - 1
    stop = text[start:start + 4]
    assert len(stop) == 4
    cut = text.find(stop)
    result = spec.run(prompt_ids=[5, 6, 7], max_new_tokens=40, ignore_eos=True, stop_strings=[stop], block_size=block_size)
    assert result.text == text[:cut]
    assert result.stats.stop_reason == "stop_string"
    # the kept tokens are the fewest whose text contains the stop string
    kept = result.token_ids
    assert kept == reference.token_ids[:len(kept)]
    assert stop in plain.tokenizer.decode(kept) and stop not in plain.tokenizer.decode(kept[:-1])


def test_keyboard_interrupt_returns_what_was_produced(planted_pair):
    engine = make(planted_pair["target"], planted_pair["draft"])
    forward = engine.target.forward
    calls = {"n": 0}

    def interrupted_forward(*args, **kwargs):  # the real forward, interrupted on the 4th cycle
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    engine.target.forward = interrupted_forward
    chunks = list(engine.generate(prompt_ids=[5, 6, 7], max_new_tokens=100, ignore_eos=True))
    produced = [t for c in chunks for t in c.token_ids]
    assert engine.last_stats.stop_reason == "interrupted"
    assert produced == engine.last_token_ids and 1 <= len(produced) < 100
    expected = make(planted_pair["target"]).run(prompt_ids=[5, 6, 7], max_new_tokens=len(produced), ignore_eos=True)
    assert produced == expected.token_ids


def test_keyboard_interrupt_in_run_many_returns_what_each_request_produced(planted_pair):
    """Ctrl-C inside a batched forward ends every request with its tokens so far (``interrupted``),
    a request still waiting for a slot with none, and leaves the engine usable."""
    from speculant.backends.torch.target import decoder_parts

    engine = make(planted_pair["target"], planted_pair["draft"])
    calls = {"n": 0}

    def tick(*_):  # where Ctrl-C lands: the first decoder layer of the 5th forward
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt

    prompts = [[5, 6, 7], [8, 9], [5, 9, 6, 8]]
    handle = decoder_parts(engine.target.model)[1][0].register_forward_pre_hook(tick)
    try:
        results = engine.run_many(prompt_ids=prompts, max_new_tokens=100, ignore_eos=True, max_batch=2)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped run_many: every request's tokens were lost")
    finally:
        handle.remove()
    assert calls["n"] == 5 and [r.stats.stop_reason for r in results] == ["interrupted"] * 3
    assert [len(r.token_ids) > 0 for r in results] == [True, True, False]  # the third never got a slot
    plain = make(planted_pair["target"])
    for ids, result in zip(prompts, results):
        assert result.stats.new_tokens == len(result.token_ids) < 100
        assert result.token_ids == plain.run(prompt_ids=ids, max_new_tokens=max(1, len(result.token_ids)),
                                             ignore_eos=True).token_ids[:len(result.token_ids)]
    assert len(engine.run_many(prompt_ids=prompts, max_new_tokens=3)) == 3


def test_nan_logits_raise_with_tokens_so_far(tmp_path, torch_threads):
    from safetensors.torch import load_file, save_file

    from speculant.testing.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "t", seed=0)
    good = make(target).run(prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True).token_ids
    index = next(i for i in range(2, 30) if good[i] not in good[:i] and good[i] not in (5, 6, 7))
    poisoned = good[index]
    state = load_file(str(target / "model.safetensors"))
    state["model.embed_tokens.weight"][poisoned] = float("nan")
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteLogitsError) as info:
        make(target).run(prompt_ids=[5, 6, 7], max_new_tokens=30, ignore_eos=True)
    assert info.value.token_ids == good[: index + 1]


def test_prompt_longer_than_window_is_a_clear_error(plain):
    window = plain.target.info.max_position_embeddings
    with pytest.raises(ContextTooLongError, match="context window"):
        plain.run(prompt_ids=[5] * window, max_new_tokens=4)


def test_generation_stops_at_the_window(spec, plain):
    window = spec.target.info.max_position_embeddings
    prompt = [5, 6, 7] * ((window - 10) // 3)
    result = spec.run(prompt_ids=prompt, max_new_tokens=50, ignore_eos=True)
    assert result.stats.stop_reason == "context_length"
    assert len(prompt) + len(result.token_ids) == window
    assert result.token_ids == plain.run(prompt_ids=prompt, max_new_tokens=50, ignore_eos=True).token_ids


def test_a_bad_prompt_among_many_is_named_by_its_index_before_anything_runs(plain):
    """``generate_many`` checks every prompt and setting first; an error names the prompt to fix."""
    from speculant.core.errors import SettingError

    window = plain.target.info.max_position_embeddings
    with pytest.raises(ContextTooLongError, match="^prompt 2: the prompt has"):
        plain.run_many(prompt_ids=[[5, 6], [7], [5] * window], max_new_tokens=4)
    with pytest.raises(SettingError, match="^prompt 1: prompt_ids: contains ids outside the vocabulary"):
        plain.run_many(prompt_ids=[[5, 6], [10**6]], max_new_tokens=4)
    with pytest.raises(SettingError, match="^prompt 0: prompt_ids: the prompt is empty"):
        plain.run_many(prompt_ids=[[], [5]], max_new_tokens=4)
    with pytest.raises(SettingError, match="^prompt 1: "):
        plain.run_many(["def f():", ""], max_new_tokens=4)
    with pytest.raises(SettingError, match="prompts / prompt_ids: pass exactly one"):
        plain.run_many(["def f():"], prompt_ids=[[5]])
    with pytest.raises(SettingError, match="not one string"):
        plain.run_many("def f():")
    with pytest.raises(SettingError, match="max_batch: must be a whole number of at least 1, got 0"):
        plain.run_many(prompt_ids=[[5]], max_batch=0)
    assert plain.run_many(prompt_ids=[[5, 6], [7]], max_new_tokens=2)  # the engine was left free


def test_bad_prompt_ids(plain):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        plain.run(prompt_ids=[10**6], max_new_tokens=2)
    with pytest.raises(ValueError, match="exactly one"):
        plain.run("x", prompt_ids=[1], max_new_tokens=2)


def test_plain_decoding_goes_through_the_same_loop(plain):
    result = plain.run(prompt_ids=[5, 6, 7], max_new_tokens=12, ignore_eos=True)
    assert result.stats.acceptance_lengths == [1] * 11
    assert result.stats.mean_acceptance_length == 1.0


@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_untimed_cycles_never_wait_for_the_backend(planted_pair, backend):
    """Without a timing verifier the loop leaves the backend free to overlap the draft with the
    target's graph building (no sync per call); ``time_phases`` and ``adaptive`` sync and time."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")

    def make(verifier):
        engine = speculant.load_engine({
            "backend": {"kind": backend, "device": "cpu", "dtype": "float32"},
            "target": {"path": str(planted_pair["target"])},
            "drafter": {"kind": "dflash", "path": str(planted_pair["draft"]), "block_size": 8},
            "verifier": {"kind": verifier}})
        calls = []
        original = engine.backend.synchronize
        engine.backend.synchronize = lambda: calls.append(1) or original()
        return engine, calls

    prompt = list(range(10, 40))
    untimed, untimed_calls = make("greedy")
    plain_ids = untimed.without_drafter().run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True).token_ids
    result = untimed.run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True)
    assert result.token_ids == plain_ids and result.stats.verify_steps > 1
    assert untimed_calls == [] and not result.stats.phases_timed
    assert result.stats.target_s == 0.0 and result.stats.overhead_s is None

    untimed.time_phases = True
    timed = untimed.run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True)
    assert timed.token_ids == plain_ids and timed.stats.phases_timed
    assert len(untimed_calls) >= 2 * timed.stats.verify_steps  # after every draft and every target call
    assert 0 < timed.stats.target_s < timed.stats.decode_s + timed.stats.prefill_s and timed.stats.draft_s > 0

    adaptive, adaptive_calls = make("adaptive")
    assert adaptive.run(prompt_ids=prompt, max_new_tokens=24, ignore_eos=True).stats.phases_timed
    assert adaptive_calls
