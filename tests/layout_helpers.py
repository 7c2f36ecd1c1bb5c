"""Shared by the CPU weight-layout tests (transposed or packed on PyTorch, transposed on MLX): a speculative run
over the new layout gives the same tokens and acceptance lengths as over the layers as loaded."""

from __future__ import annotations

PROMPT = [5, 6, 7]


def assert_same_speculation(fast_engine, dense_engine):
    """Tokens and acceptance lengths of ``fast_engine`` equal ``dense_engine``'s and plain
    decoding's, with partial rejections; returns (fast result, plain result)."""
    kwargs = dict(prompt_ids=PROMPT, max_new_tokens=64, block_size=16, ignore_eos=True)
    fast, slow = fast_engine.run(**kwargs), dense_engine.run(**kwargs)
    plain = dense_engine.without_drafter().run(**kwargs)
    assert fast.token_ids == slow.token_ids == plain.token_ids
    assert fast.stats.acceptance_lengths == slow.stats.acceptance_lengths
    assert min(fast.stats.acceptance_lengths) < 16 < max(fast.stats.acceptance_lengths) + 1
    assert fast_engine.without_drafter().run(**kwargs).token_ids == plain.token_ids
    return fast, plain


def assert_laid_out(fast_engine, layers, linear, laid_out):
    """Neither the target nor the draft of ``fast_engine`` keeps a ``linear`` layer, and both
    have ``laid_out`` ones (``layers(model, kind)``: the model's modules of exactly that kind)."""
    for model in (fast_engine.target.model, fast_engine.drafter.net.model):
        assert layers(model, linear) == [] and len(layers(model, laid_out)) > 0
