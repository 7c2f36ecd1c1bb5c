"""The target-side distribution p, and inverse-CDF sampling, written once over ArrayOps (shared by
the verifiers and by drafters that sample their drafts).

Plain decoding and speculative verification both go through :func:`target_probs`, so the
distribution a draft is accepted against is exactly the one plain sampling draws from.

Order (as in Hugging Face and vLLM): float32 logits -> divide by temperature -> top-k ->
softmax -> top-p -> renormalise. Ties at a cut-off are kept: top-k keeps every token whose
tempered logit equals the k-th largest, top-p every token whose probability equals the
smallest one kept.

Sampling uses a uniform drawn on the host from a ``numpy.random.Generator``, so every backend
consumes the same random stream and makes the same choice.
"""

from __future__ import annotations

import math
from typing import Any

from speculant.core.arrays import Array, ArrayOps
from speculant.core.types import SamplingParams


def tempered_logits(ops: ArrayOps, logits: Array, sampling: SamplingParams) -> Array:
    """float32 logits divided by the temperature, with tokens outside the top-k set to -inf."""
    if sampling.is_greedy:
        raise ValueError("temperature 0 means greedy decoding, which has no sampling distribution; use argmax")
    z = ops.float32(logits) / float(sampling.temperature)
    top_k = int(sampling.top_k)
    if 0 < top_k < z.shape[-1]:
        kth = ops.sort_descending(z)[..., top_k - 1 : top_k]
        z = ops.where(z < kth, -math.inf, z)
    return z


def top_p_filter(ops: ArrayOps, probs: Array, top_p: float) -> Array:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise.

    A token is kept when the mass of the tokens strictly more likely than it (in sorted
    order) is below ``top_p``; the most likely token is always kept.
    """
    if top_p >= 1.0:
        return probs
    s = ops.sort_descending(probs)
    mass_before = ops.cumsum(s) - s
    smallest_kept = -ops.max(ops.where(mass_before < top_p, -s, -math.inf), keepdims=True)
    # a top_p that is 0 in float32 (5e-324) keeps no token above: the most likely one stays
    smallest_kept = ops.where(smallest_kept > s[..., :1], s[..., :1], smallest_kept)
    kept = ops.where(probs < smallest_kept, 0.0, probs)
    return kept / ops.sum(kept, keepdims=True)


def target_probs(ops: ArrayOps, logits: Array, sampling: SamplingParams) -> Array:
    """The processed target distribution p for every row of ``logits`` ([..., V] float32).

    Rows that contain NaN or +inf, that overflow when divided by the temperature, or whose
    tokens are all masked (-inf) come out as NaN rows; ``ops.max(p)`` flags them.
    """
    probs = ops.softmax(tempered_logits(ops, logits, sampling))
    return top_p_filter(ops, probs, float(sampling.top_p))


def inverse_cdf(ops: ArrayOps, probs: Array, u: float | Array) -> Array:
    """Per row, the token that the uniform ``u`` in [0, 1) selects by inverse CDF.

    ``u`` is a host float shared by every row, or a float32 array [..., 1] with one per row.

    ``probs`` [..., V] need not be normalised but must have positive finite mass. The index
    is the number of CDF entries ``<= u * total``: the first token whose cumulative mass
    exceeds ``u * total``, which always has positive mass (also for ``u = 0``). Rounding
    that would step past the end is clipped to the last token with positive mass, so the
    result is never >= V and never a token with p = 0. Returned as float32 [...] holding
    exact integers (``to_list`` then ``int``).
    """
    scale = float(u) if isinstance(u, (int, float)) else u  # a NumPy float64 would upcast
    cdf = ops.cumsum(probs)
    total = cdf[..., -1:]
    picked = ops.sum(ops.float32(cdf <= total * scale))
    last_with_mass = ops.sum(ops.float32(cdf < total))
    return ops.where(picked < last_with_mass, picked, last_with_mass)


def sample_token(ops: ArrayOps, probs: Array, rng: Any) -> int:
    """Draw one token id from a single probability row [V] with one uniform from ``rng``."""
    u = float(rng.random())
    return int(ops.to_list(inverse_cdf(ops, probs[None, :], u))[0])
