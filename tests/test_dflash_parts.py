"""Parts of the DFlash draft that decoding takes shortcuts through: the attention mask that is
skipped when every key is visible (PyTorch and MLX), cached RoPE spans and the in-place context
cache (PyTorch)."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from speculant.drafters.dflash.config import parse_config  # noqa: E402
from speculant.drafters.dflash.torch import ContextCache, Rotary, allocate, attention_mask  # noqa: E402
from speculant.embedded import PAIR_DIR  # noqa: E402


def brute_mask(ctx_start, ctx_length, block_start, block_length, causal, window):
    keys = list(range(ctx_start, ctx_start + ctx_length)) + list(range(block_start, block_start + block_length))
    rows = []
    for q in range(block_start, block_start + block_length):
        rows.append([(not causal or q - k >= 0) and (window is None or (q - k < window and (causal or q - k > -window)))
                     for k in keys])
    return torch.tensor(rows, dtype=torch.bool)


def torch_mask(ctx_start, ctx_length, block_start, block_length, causal, window):
    return attention_mask(ctx_start, ctx_length, block_start, block_length, causal, window)


def mlx_mask(ctx_start, ctx_length, block_start, block_length, causal, window):
    pytest.importorskip("mlx.core")
    import numpy as np

    from speculant.drafters.dflash.mlx import block_mask

    keep = block_mask(ctx_length, ctx_start + ctx_length, block_start, block_length, causal, window)
    return None if keep is None else torch.from_numpy(np.array(keep))


@pytest.mark.parametrize("build", [torch_mask, mlx_mask], ids=["torch", "mlx"])
@pytest.mark.parametrize("causal,window", [(False, None), (False, 4), (False, 9), (True, None), (True, 6)])
def test_mask_is_skipped_exactly_when_every_key_is_visible(build, causal, window):
    for ctx_start, ctx_length, block_length in itertools.product((0, 3), (0, 1, 5), (1, 4, 8)):
        block_start = ctx_start + ctx_length
        expected = brute_mask(ctx_start, ctx_length, block_start, block_length, causal, window)
        got = build(ctx_start, ctx_length, block_start, block_length, causal, window)
        if got is None:
            assert bool(expected.all()), (ctx_start, ctx_length, block_length)
        else:
            assert torch.equal(got, expected), (ctx_start, ctx_length, block_length)
    if not causal and window is not None:  # a window that hides keys builds a mask
        assert build(0, 2 * window, 2 * window, 8, causal, window) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_rope_spans_equal_tables_computed_for_the_positions(dtype):
    cfg, problems = parse_config(PAIR_DIR / "dflash")
    assert cfg is not None, problems
    rotary = Rotary(cfg)
    for start, count in [(0, 9), (250, 9), (255, 300), (3, 1)]:  # the second-last grows the tables past 256
        cos, sin = rotary.span(start, count, dtype, torch.device("cpu"))
        want_cos, want_sin = rotary(torch.arange(start, start + count), dtype)
        assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_context_cache_joins_blocks_in_place_as_concatenation_would(window):
    """Commits of varying size, each followed by a block joined in place (never committed): the
    keys/values attended to and the first kept position equal those of plain concatenation,
    through buffer growth and, for a sliding layer, compaction."""
    gen = torch.Generator().manual_seed(0)
    cache = ContextCache([window], allocate)
    kept_k = kept_v = torch.empty(2, 0, 4)
    start = position = 0
    buffers = []  # every buffer the cache used (held, so none is freed and reused)
    for n in [7, 1, 3, 0, 8, 2, 30, 1, 1, 5, 64, 2] * 3:
        k, v = torch.randn(2, n, 4, generator=gen), torch.randn(2, n, 4, generator=gen)
        cache.append(0, k, v, position, reserve=4)
        kept_k, kept_v = torch.cat([kept_k, k], 1), torch.cat([kept_v, v], 1)
        position += n
        if window is not None and kept_k.shape[1] > window - 1:
            start += kept_k.shape[1] - (window - 1)
            kept_k, kept_v = kept_k[:, -(window - 1):], kept_v[:, -(window - 1):]
        block_k, block_v = torch.randn(2, 4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
        keys, values = cache.slot(0).join(block_k, block_v)
        assert torch.equal(keys, torch.cat([kept_k, block_k], 1)) and torch.equal(values, torch.cat([kept_v, block_v], 1))
        assert cache.starts[0] == start and cache.length(0) == kept_k.shape[1]
        if not any(b is cache.keys[0] for b in buffers):
            buffers.append(cache.keys[0])
    assert len(buffers) <= 8  # reallocated now and then (36 cycles here), not every cycle


@pytest.mark.parametrize("window", [None, 5])
def test_context_cache_writes_the_same_rows_in_place_on_mlx(window):
    """The one cache on MLX arrays ([1, kv_heads, n, hd], written by slice assignment): the same
    commits and joins give the same keys/values and positions as on torch tensors."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    from speculant.drafters.dflash.mlx import allocate as mlx_allocate

    gen = torch.Generator().manual_seed(1)
    on_torch, on_mlx = ContextCache([window], allocate), ContextCache([window], mlx_allocate)
    position = 0
    for n in [7, 1, 3, 30, 1, 64, 2, 5]:
        k, v = torch.randn(2, n, 4, generator=gen), torch.randn(2, n, 4, generator=gen)
        on_torch.append(0, k, v, position, reserve=4)
        on_mlx.append(0, mx.array(k.numpy())[None], mx.array(v.numpy())[None], position, reserve=4)
        position += n
        block_k, block_v = torch.randn(2, 4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
        want = on_torch.slot(0).join(block_k, block_v)
        got = on_mlx.slot(0).join(mx.array(block_k.numpy())[None], mx.array(block_v.numpy())[None])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(g[0]), w.numpy())
        assert (on_mlx.starts, on_mlx.length(0)) == (on_torch.starts, on_torch.length(0))
