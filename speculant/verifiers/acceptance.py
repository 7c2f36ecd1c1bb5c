"""The lossless acceptance rules, as pure functions over ArrayOps shared by every verifier.

Greedy: keep the longest prefix of drafts equal to the target's argmax rows, then emit the
argmax of the next row. Sampling (Leviathan et al. 2211.17192; Chen et al. 2302.01318):
accept draft x_i iff ``u_i * q_i(x_i) < p_i(x_i)``; at the first rejection emit a token from
``normalise(max(0, p_i - q_i))`` (p_i itself if that has no mass); after k acceptances emit
a bonus token from p_k. ``draft=None`` is plain decoding from row 0.

Each cycle makes one device-to-host transfer: a short float32 vector with the per-row
argmax or candidate tokens, the per-row maxima (to detect NaN/inf rows), the target and
draft probabilities of the drafted tokens, and the draft ids. Token ids travel as float32,
which is exact below 2**24. So that one transfer suffices, a candidate token is drawn for
every row before the accept decisions are known (residual rows at drafted positions, p at
the bonus row), all with the same uniform; only one of them is ever emitted.

Uniforms come from a host ``numpy.random.Generator``: k + 1 per sampled cycle (none at
temperature 0), whatever the outcome, so seeded runs are reproducible and identical across
backends.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from speculant.core.arrays import Array, ArrayOps
from speculant.core.errors import NonFiniteLogitsError
from speculant.core.types import Draft, SamplingParams, Verification
from speculant.verifiers.processing import inverse_cdf, target_probs

MAX_EXACT_TOKEN_ID = 2**24


def num_drafts(draft: Draft | None) -> int:
    return 0 if draft is None else int(draft.num_tokens)


def verify_rows(target_logits: Array, k: int) -> Array:
    """The k + 1 target rows a cycle with k drafts uses, after checking the shape."""
    shape = tuple(target_logits.shape)
    if len(shape) != 2:
        raise ValueError(f"target_logits must be [k+1, V]; got shape {shape}")
    if shape[0] < k + 1:
        raise ValueError(f"target_logits has {shape[0]} rows but the draft has {k} tokens; {k + 1} rows are needed")
    if shape[1] > MAX_EXACT_TOKEN_ID:
        raise ValueError(f"vocabulary size {shape[1]} exceeds the supported maximum {MAX_EXACT_TOKEN_ID}")
    return target_logits if shape[0] == k + 1 else target_logits[: k + 1]


def fetch(ops: ArrayOps, parts: Sequence[Array]) -> list[float]:
    """Move several small 1-D arrays to the host in one transfer, as float32 values."""
    return ops.to_list(ops.concatenate([ops.float32(p) for p in parts]))


def greedy_verify(ops: ArrayOps, draft: Draft | None, target_logits: Array) -> Verification:
    """Longest prefix of drafts equal to the target's argmax, then the next argmax.

    Ties go to the lowest index (the backends' argmax), exactly as plain greedy decoding.
    """
    k = num_drafts(draft)
    rows = verify_rows(target_logits, k)
    parts = [ops.argmax(rows), ops.max(rows)]
    if k:
        parts.append(draft.token_ids[:k])
    host = fetch(ops, parts)
    best, row_max, drafts = host[: k + 1], host[k + 1 : 2 * k + 2], [int(t) for t in host[2 * k + 2 :]]
    accepted = 0
    while True:
        if not math.isfinite(row_max[accepted]):
            raise NonFiniteLogitsError(_non_finite_message(accepted, row_max[accepted]))
        if accepted == k or drafts[accepted] != int(best[accepted]):
            break
        accepted += 1
    return Verification(accepted, drafts[:accepted] + [int(best[accepted])])


def accept_draft(target_prob: float, draft_prob: float, u: float) -> bool:
    """Accept with probability min(1, p/q): ``u * q < p`` with u in [0, 1).

    Strict, so p = 0 is rejected even when u = 0; q = 0 (or NaN) is rejected outright.
    """
    return draft_prob > 0.0 and u * draft_prob < target_prob


def residual(ops: ArrayOps, target: Array, draft_full: Array) -> Array:
    """Unnormalised residual max(0, p - q) for rejected rows."""
    return ops.maximum(target - draft_full, 0.0)


def draft_rows(
    ops: ArrayOps, x: Array, draft_probs: Array | None, candidate_ids: Array | None, shape: tuple[int, int, int]
) -> Array:
    """q over the full vocabulary for every cycle row [B * (k + 1), V]; zero at bonus rows.

    ``x`` [B * (k + 1)] holds the drafted tokens (any valid id at bonus rows). One-hot drafts
    put mass 1 at x; dense q [B, k, V] is used as is; sparse q [B, k, C] is scattered onto
    its candidate ids [B, k, C] (duplicate ids add up).
    """
    b, k, vocab_size = shape
    n = b * (k + 1)
    zeros = ops.full((n, vocab_size), 0.0)
    if draft_probs is None:
        weight = ops.concatenate([ops.full((b, k), 1.0), ops.full((b, 1), 0.0)], axis=1).reshape((n, 1))
        return ops.scatter_add(zeros, x[:, None], weight)
    q = ops.float32(draft_probs)
    width = vocab_size if candidate_ids is None else int(candidate_ids.shape[-1])
    if tuple(q.shape) != (b, k, width) or (candidate_ids is not None and tuple(candidate_ids.shape) != (b, k, width)):
        what = "dense draft_probs must be [k, V]"
        if candidate_ids is not None:
            what = "sparse draft_probs and candidate_ids must both be [k, C]"
        found = tuple(q.shape) if candidate_ids is None else (tuple(q.shape), tuple(candidate_ids.shape))
        raise ValueError(f"{what} with k = {k}, V = {vocab_size}; got {found}")
    q = ops.concatenate([q, q[:, -1:] * 0.0], axis=1).reshape((n, width))
    if candidate_ids is None:
        return q
    ids = ops.concatenate([candidate_ids, candidate_ids[:, -1:]], axis=1).reshape((n, width))
    return ops.scatter_add(zeros, ids, q)


def speculative_verify(
    ops: ArrayOps, draft: Draft | None, target_logits: Array, sampling: SamplingParams, rng: Any
) -> Verification:
    """Lossless speculative sampling of one cycle; the exact greedy rule at temperature 0."""
    if sampling.is_greedy:
        return greedy_verify(ops, draft, target_logits)
    k = num_drafts(draft)
    rows = verify_rows(target_logits, k)
    if k == 0:
        u = float(rng.random())
        probs = target_probs(ops, rows, sampling)
        row_max, token = fetch(ops, [ops.max(probs), inverse_cdf(ops, probs, u)])
        if not 0.0 < row_max < math.inf:
            _raise_non_finite(ops, rows, sampling, 0, 0)
        return Verification(0, [int(token)])
    draft_probs = None if draft.draft_probs is None else draft.draft_probs[:k][None]
    candidate_ids = None if draft.candidate_ids is None else draft.candidate_ids[:k][None]
    return speculative_verify_batch(ops, draft.token_ids[:k][None], rows[None], sampling, rng, draft_probs, candidate_ids)[0]


def speculative_verify_batch(
    ops: ArrayOps,
    token_ids: Array,
    target_logits: Array,
    sampling: SamplingParams,
    rng: Any,
    draft_probs: Array | None = None,
    candidate_ids: Array | None = None,
) -> list[Verification]:
    """B independent cycles of k >= 1 drafts each (temperature > 0).

    ``token_ids`` [B, k]; ``target_logits`` [B, k + 1, V]; q is None (one-hot drafts),
    ``draft_probs`` [B, k, V] (dense), or ``draft_probs`` [B, k, C] over ``candidate_ids``
    [B, k, C] (sparse). Uniforms are ``rng.random((B, k + 1))``, the same stream B single
    cycles consume, so a batch gives the same tokens as B calls of
    :func:`speculative_verify`. The engine uses B = 1; tests use large B.
    """
    b, k = (int(n) for n in token_ids.shape)
    vocab_size = int(target_logits.shape[-1])
    if k < 1 or tuple(target_logits.shape) != (b, k + 1, vocab_size):
        raise ValueError(
            "expected token_ids [B, k >= 1] and target_logits [B, k+1, V]; "
            f"got {tuple(token_ids.shape)} and {tuple(target_logits.shape)}"
        )
    if vocab_size > MAX_EXACT_TOKEN_ID:
        raise ValueError(f"vocabulary size {vocab_size} exceeds the supported maximum {MAX_EXACT_TOKEN_ID}")
    n = b * (k + 1)
    u = rng.random((b, k + 1))
    rows = target_logits.reshape((n, vocab_size))
    probs = target_probs(ops, rows, sampling)
    x = ops.concatenate([token_ids, token_ids[:, -1:]], axis=1).reshape((n,))
    q_full = draft_rows(ops, x, draft_probs, candidate_ids, (b, k, vocab_size))
    candidates = residual(ops, probs, q_full)
    mass = ops.sum(candidates, keepdims=True)
    candidates = ops.where((mass > 0.0) & (mass < math.inf), candidates, probs)
    u_pick = float(u[0, k]) if b == 1 else ops.asarray(u[:, k].repeat(k + 1)[:, None])
    parts = [ops.max(probs), inverse_cdf(ops, candidates, u_pick)]
    parts += [ops.gather(probs, x[:, None])[:, 0], ops.gather(q_full, x[:, None])[:, 0], x]
    host = fetch(ops, parts)
    return [_decide(ops, rows, sampling, host, u_row, i * (k + 1), k, n) for i, u_row in enumerate(u.tolist())]


def _decide(
    ops: ArrayOps, rows: Array, sampling: SamplingParams, host: list[float], u: list[float], first: int, k: int, n: int
) -> Verification:
    """The host side of the cycle whose rows start at ``first``.

    ``host`` holds n row maxima, n candidate tokens, n values p(x), n values q(x), n draft ids.
    """
    accepted = 0
    while True:
        r = first + accepted
        if not 0.0 < host[r] < math.inf:  # NaN fails too
            _raise_non_finite(ops, rows, sampling, r, accepted)
        if accepted == k or not accept_draft(host[2 * n + r], host[3 * n + r], u[accepted]):
            break
        accepted += 1
    tokens = [int(t) for t in host[4 * n + first : 4 * n + first + accepted]]
    tokens.append(int(host[n + first + accepted]))
    return Verification(accepted, tokens)


def _raise_non_finite(ops: ArrayOps, rows: Array, sampling: SamplingParams, r: int, row: int) -> None:
    """Processed row ``r`` (cycle row ``row``) is not a distribution: say why."""
    raw_max = ops.to_list(ops.max(ops.float32(rows[r : r + 1])))[0]
    raise NonFiniteLogitsError(_non_finite_message(row, raw_max, sampling.temperature))


def _non_finite_message(row: int, row_max: float, temperature: float | None = None) -> str:
    if math.isnan(row_max):
        what = "contain NaN"
    elif row_max == math.inf:
        what = "contain +inf"
    elif row_max == -math.inf:
        what = "mask every token (all -inf)"
    else:
        what = f"overflow to infinity when divided by the temperature {temperature}"
    return (
        f"the target's logits at verify row {row} {what}; generation stopped. "
        "The tokens produced so far are in the error's token_ids. Check the model's dtype "
        "(float16 overflows are common: try bfloat16 or float32) and any logits masks."
    )
