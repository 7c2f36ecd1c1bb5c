"""MLX fast path: ``MLXTarget.greedy_steps`` (plain greedy decoding pipelined like mlx-lm's
``generate_step``) gives exactly the tokens of the step-by-step plain loop, and leaves a cache that
``crop`` brings back to the plain loop's, on full-attention (llama), Gated DeltaNet hybrid (qwen3_5)
and sliding-window (mistral) targets, eager and compiled; and ``backend.compile`` decides what runs
compiled.

The step-by-step reference drives the same target the way the engine's plain loop does
(prefill, then a one-token ``forward`` per token, argmax, ``crop``). After ``greedy_steps`` is
closed and the cache cropped, decoding continues with both paths and must still match: a crop
that left the pipelined step's state behind (or raised) fails there.
"""

from __future__ import annotations

import numpy as np
import pytest

import speculant

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
pytestmark = pytest.mark.mlx

WINDOW = 16
PROMPT = 24  # longer than the sliding window
NEW = 40  # crosses the window again during decoding


def config(target, compile: str = "auto") -> dict:
    return {"backend": {"kind": "mlx", "device": "cpu", "dtype": "float32", "compile": compile},
            "target": {"path": str(target)}}


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "mistral"])
def engine(request, tmp_path_factory, torch_threads):
    from speculant.testing.tiny_families import build_tiny_family

    path = build_tiny_family(tmp_path_factory.mktemp(request.param) / "target", request.param, sliding_window=WINDOW)
    return speculant.load_engine(config(path))


def prompt(vocab: int = 300) -> list[int]:
    return [int(t) for t in np.random.default_rng(3).integers(5, vocab, PROMPT)]


def argmax(logits) -> int:
    return int(np.argmax(np.array(logits[-1])))


def stepwise(target, backend, anchor: int, n: int) -> list[int]:
    """``n`` plain greedy tokens after ``anchor`` (not yet in the cache), one forward each."""
    out = []
    for _ in range(n):
        position = target.cache_length
        anchor = argmax(target.forward(backend.int_array([anchor])).logits)
        target.crop(position + 1)
        out.append(anchor)
    return out


def pipelined(target, anchor: int, n: int) -> list[int]:
    """``n`` tokens from ``greedy_steps``, then closed and cropped as the engine does."""
    start = target.cache_length
    steps = target.greedy_steps(anchor)
    out = [next(steps) for _ in range(n)]
    steps.close()
    assert target.cache_length == start + n + 1  # one step ahead of the tokens handed out
    target.crop(start + n)
    return out


def test_greedy_steps_equal_the_plain_loop_and_crop_back(engine):
    target, backend, ids = engine.target, engine.backend, prompt()
    target.reset()
    first = argmax(target.prefill(ids).logits)
    reference = [first] + stepwise(target, backend, first, NEW)

    target.reset()
    first = argmax(target.prefill(ids).logits)
    got = [first] + pipelined(target, first, NEW // 2)
    assert target.cache_length == PROMPT + NEW // 2
    got += pipelined(target, got[-1], NEW // 4)  # again from the cropped cache
    got += stepwise(target, backend, got[-1], NEW - len(got) + 1)  # and the plain loop after it
    assert got == reference
    assert len(set(reference)) > 3  # a degenerate target would hide a wrong feed


def test_engine_plain_greedy_takes_the_pipelined_path(engine):
    """The engine's plain greedy requests run through greedy_steps and give the step-by-step tokens."""
    target, backend, ids = engine.target, engine.backend, prompt()
    target.reset()
    first = argmax(target.prefill(ids).logits)
    reference = [first] + stepwise(target, backend, first, NEW - 1)
    calls = []
    target.greedy_steps = lambda anchor: calls.append(anchor) or type(target).greedy_steps(target, anchor)
    try:
        result = engine.run(prompt_ids=ids, max_new_tokens=NEW, ignore_eos=True)
    finally:
        del target.greedy_steps
    assert calls == [first]
    assert result.token_ids == reference
    assert target.cache_length == PROMPT + NEW - 1  # cropped back: the last token is the next anchor


KINDS = {"llama": "4 full-attention layers", "mistral": "4 sliding-window (a ring each) layers",
         "qwen3_5": "1 full-attention and 3 Gated DeltaNet layers"}


def family(engine) -> str:
    from speculant.backends.mlx.families import family

    return family(engine.target.info)


def test_compile_auto_on_the_cpu(engine):
    """auto compiles the whole forward on the CPU, whatever the layers' kinds, and says which."""
    target = engine.target
    assert target._static is not None
    assert "whole forwards compiled" in target.fast_path
    assert f"{KINDS[family(engine)]} over a static cache" in target.fast_path


def eager_engine(engine):
    return speculant.load_engine(config(engine.config.target.path, compile="off"))


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "blocks"])
def test_compiled_forwards_give_the_eager_forwards(engine, whole, monkeypatch):
    """backend.compile=on: the whole forward runs compiled or, where the load-time check refuses
    it, every feed-forward block does; a verify block, plain steps and the pipelined steps give the
    eager target's results, across the static cache's growth (64 rows: capacity 32, then 64)."""
    from speculant.backends.mlx import static
    from speculant.backends.mlx.compiled import CompiledBlock

    eager = eager_engine(engine)
    if not whole:
        monkeypatch.setattr(static, "check", lambda model, forward: "refused by the test")
    compiled = speculant.load_engine(config(engine.config.target.path, compile="on"))
    layers = compiled.target._inner.layers
    assert (compiled.target._static is not None) == whole
    assert all(isinstance(layer.module.mlp, CompiledBlock) != whole for layer in layers)
    if not whole:
        assert "whole forward not compiled: refused by the test" in compiled.target.fast_path
    ids, block = prompt(), [7, 9, 11, 13, 15]
    logits = []
    for e in (eager, compiled):
        e.target.reset()
        e.target.prefill(ids)
        logits.append(np.array(e.target.forward(e.backend.int_array(block)).logits))
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    target, backend = compiled.target, compiled.backend
    target.reset()
    first = argmax(target.prefill(ids).logits)
    got = [first] + pipelined(target, first, NEW // 2)
    got += stepwise(target, backend, got[-1], NEW - len(got) + 1)
    eager.target.reset()
    first = argmax(eager.target.prefill(ids).logits)
    assert got == [first] + stepwise(eager.target, eager.backend, first, NEW)
