"""The lossless acceptance rules, as pure functions over ArrayOps shared by every verifier.

Speculative sampling (Leviathan et al. 2211.17192; Chen et al. 2302.01318): accept draft x_i
iff ``u_i * q_i(x_i) < p_i(x_i)``; at the first rejection emit a token from
``normalise(max(0, p_i - q_i))`` (p_i itself if that has no mass); after k acceptances emit
a bonus token from p_k. ``draft=None`` is plain decoding from row 0. The greedy rule is its
temperature-0 case (:func:`greedy_verify`): p_i is the point mass at the argmax, so a draft
passes iff it is the argmax, and the argmax is emitted where the walk stops. Both end in the
same host-side walk over the cycle's rows (:func:`settle`).

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
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Sequence

from speculant.core.arrays import Array, ArrayOps, fetch
from speculant.core.errors import NonFiniteLogitsError
from speculant.core.types import Draft, PendingVerification, SamplingParams, Verification
from speculant.core.sampling import inverse_cdf, target_probs

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


def greedy_verify(ops: ArrayOps, draft: Draft | None, target_logits: Array) -> Verification:
    """Speculative sampling at temperature 0: the longest prefix of drafts equal to the target's
    argmax, then the next argmax.

    p is the point mass at the argmax and a draft counts as the point mass at x, whatever it
    proposed, so p(x) / q(x) is 1 or 0 and no uniform is needed; a rejected x leaves the residual
    max(0, p - q) = p, so the argmax is emitted, as it is at the bonus row. Ties go to the lowest
    index (the backends' argmax), exactly as plain greedy decoding.
    """
    pending = greedy_pending(ops, draft, target_logits)
    return pending.finish(fetch(ops, pending.parts))


def chain_pending(ops: ArrayOps, draft: Draft | None, target_logits: Array,
                  sampling: SamplingParams) -> PendingVerification | None:
    """:func:`speculative_verify` in two halves where it is greedy (a batch moves every row's first
    half to the host in one transfer); None where it samples (verified whole)."""
    return greedy_pending(ops, draft, target_logits) if sampling.is_greedy else None


def greedy_pending(ops: ArrayOps, draft: Draft | None, target_logits: Array) -> PendingVerification:
    """:func:`greedy_verify` in two halves: the argmax and max of every verify row and the drafts,
    then the walk over their host values."""
    k = num_drafts(draft)
    rows = verify_rows(target_logits, k)
    parts = [ops.argmax(rows), ops.max(rows)]
    if k:
        parts.append(draft.token_ids[:k])

    def finish(host: list[float]) -> Verification:
        best, row_max, drafts = host[: k + 1], host[k + 1 : 2 * k + 2], host[2 * k + 2 :]
        matches = [float(int(x) == int(b)) for x, b in zip(drafts, best)]
        cycle = HostCycle([math.isfinite(m) for m in row_max], best, matches, [1.0] * k, drafts)
        return settle(cycle, [0.0] * (k + 1), partial(_raise_non_finite, ops, rows, 0))

    return PendingVerification(parts, finish)


@dataclass
class HostCycle:
    """One cycle on the host, as the walk over its drafts reads it (k drafts, k + 1 rows)."""

    row_ok: list[bool]  # row r of the processed target is a distribution
    picks: list[float]  # the token emitted when the walk stops at row r (exact float32 ids)
    target_x: list[float]  # p_r(x_r)
    draft_x: list[float]  # q_r(x_r)
    drafts: list[float]  # x_r


def settle(cycle: HostCycle, u: Sequence[float], fail: Callable[[int], None]) -> Verification:
    """Accept drafts in order while their rows are distributions and they pass, then emit the
    pick of the row where the walk stopped; ``fail(row)`` raises for a row that is not."""
    k = len(cycle.drafts)
    accepted = 0
    while True:
        if not cycle.row_ok[accepted]:
            fail(accepted)
        if accepted == k or not accept_draft(cycle.target_x[accepted], cycle.draft_x[accepted], u[accepted]):
            break
        accepted += 1
    return Verification(accepted, [int(t) for t in cycle.drafts[:accepted]] + [int(cycle.picks[accepted])])


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
    if k == 0:  # plain sampling: only the bonus row
        u = float(rng.random())
        probs = target_probs(ops, rows, sampling)
        row_max, token = fetch(ops, [ops.max(probs), inverse_cdf(ops, probs, u)])
        cycle = HostCycle([0.0 < row_max < math.inf], [token], [], [], [])
        return settle(cycle, [u], partial(_raise_non_finite, ops, rows, 0, temperature=sampling.temperature))
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
    verifications = []
    for i, u_row in enumerate(u.tolist()):
        first = i * (k + 1)
        fail = partial(_raise_non_finite, ops, rows, first, temperature=sampling.temperature)
        verifications.append(settle(_sampled_cycle(host, first, k, n), u_row, fail))
    return verifications


def _sampled_cycle(host: list[float], first: int, k: int, n: int) -> HostCycle:
    """The cycle whose rows start at ``first``, out of a batch's ``host`` values: n row maxima,
    n picks, n values p(x), n values q(x), n draft ids."""
    def part(i: int, length: int) -> list[float]:
        return host[i * n + first : i * n + first + length]

    return HostCycle([0.0 < m < math.inf for m in part(0, k + 1)], part(1, k + 1), part(2, k), part(3, k), part(4, k))


def _raise_non_finite(ops: ArrayOps, rows: Array, first: int, row: int, temperature: float | None = None) -> None:
    """Row ``row`` of the cycle whose rows start at ``rows[first]`` does not give a distribution: say why."""
    r = first + row
    raw_max = ops.to_list(ops.max(ops.float32(rows[r : r + 1])))[0]
    raise NonFiniteLogitsError(_non_finite_message(row, raw_max, temperature))


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
