"""The DFlash2 candidate-path walk, on the host, shared by every backend.

A backend computes one :class:`ScoreTable` per round on the device and copies it to the host
in a single transfer; the walk itself is plain NumPy float32, so PyTorch and MLX make the same
choices from the same scores and the same uniforms.

For draft rows t = 0..k-1 with candidates C_t (top-K of the row's processed logits), unary
scores U_t and gate z_t = W_h h_t, the score of candidate b after predecessor a is
S_t(a, b) = U_t(b) + <A[a] * z_t, B[b]>. The predecessor of row 0 is the anchor token; the
predecessor of row t > 0 is the token chosen at row t - 1, which is one of C_{t-1}, so the
table holds row 0 for the anchor and a K x K block per later row.

- Greedy: walk the argmax along the chain (ties to the lower candidate index), which is not
  each row's own argmax.
- Sampling: ancestral sampling with q_t = softmax(S_t(x_{t-1}, .) / T) over the K candidates,
  by inverse CDF with one host uniform per row. The rows q_t, evaluated at the predecessor the
  walk actually took, are the sparse proposal the verifier needs; the user's top-p / top-k
  apply to the target side only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ScoreTable:
    """Selector scores of one round (host, float32).

    ``first`` [K]: S_0(anchor, C_0[j]). ``pairs`` [k-1, K, K]: ``pairs[t-1, i, j]`` =
    S_t(C_{t-1}[i], C_t[j]). ``candidates`` [k, K]: candidate token ids per row.
    """

    first: np.ndarray
    pairs: np.ndarray
    candidates: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.candidates.shape[0])

    def row(self, t: int, previous: int | None) -> np.ndarray:
        """Scores of row ``t`` given the candidate index chosen at row ``t - 1``."""
        return self.first if t == 0 else self.pairs[t - 1, previous]

    @classmethod
    def from_flat(cls, flat: np.ndarray, k: int, top_k: int) -> "ScoreTable":
        """Split one transferred float32 vector: first [K], pairs [(k-1)K^2], candidates [kK].

        Token ids travel as float32, exact below 2**24 (the largest published vocabulary is
        about 2.5e5).
        """
        flat = np.asarray(flat, dtype=np.float32)
        n_pairs = (k - 1) * top_k * top_k
        first = flat[:top_k]
        pairs = flat[top_k : top_k + n_pairs].reshape(k - 1, top_k, top_k)
        candidates = flat[top_k + n_pairs :].reshape(k, top_k).astype(np.int64)
        return cls(first, pairs, candidates)


@dataclass
class Walk:
    """The chosen path: candidate slots, token ids, q rows (sampling only), confidences."""

    indices: list[int]
    token_ids: list[int]
    q: np.ndarray | None  # [k, K] float32 when sampled
    confidence: list[float]


def softmax(scores: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float32 softmax of ``scores / temperature`` over the last axis."""
    z = np.asarray(scores, dtype=np.float32) / np.float32(temperature)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z, dtype=np.float32)
    return e / e.sum(axis=-1, keepdims=True, dtype=np.float32)


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The index the uniform ``u`` in [0, 1) selects: the first whose cumulative mass exceeds
    ``u * total``; never an index with zero mass (rounding at the top is clipped)."""
    cdf = np.cumsum(probs, dtype=np.float32)
    total = cdf[-1]
    picked = int(np.count_nonzero(cdf <= total * np.float32(u)))
    last_with_mass = int(np.count_nonzero(cdf < total))
    return min(picked, last_with_mass)


def greedy_walk(table: ScoreTable) -> Walk:
    """Chain argmax; ``confidence`` = softmax(S_t(x_{t-1}, .))[x_t] at temperature 1."""
    indices, rows = [], []
    previous = None
    for t in range(table.num_rows):
        scores = table.row(t, previous)
        previous = int(np.argmax(scores))
        indices.append(previous)
        rows.append(scores)
    chosen = softmax(np.stack(rows))[np.arange(len(indices)), indices]
    return Walk(indices, _tokens(table, indices), None, chosen.tolist())


def sampled_walk(table: ScoreTable, temperature: float, uniforms) -> Walk:
    """Ancestral sampling along the chain; records q_t at the sampled predecessor."""
    if temperature <= 0:
        raise ValueError("sampled_walk needs a positive temperature; use greedy_walk at temperature 0")
    k = table.num_rows
    if len(uniforms) < k:
        raise ValueError(f"sampled_walk needs {k} uniforms, got {len(uniforms)}")
    q = np.empty(table.candidates.shape, dtype=np.float32)
    indices, confidence = [], []
    previous = None
    for t in range(k):
        q[t] = softmax(table.row(t, previous), temperature)
        previous = inverse_cdf(q[t], float(uniforms[t]))
        indices.append(previous)
        confidence.append(float(q[t, previous]))
    return Walk(indices, _tokens(table, indices), q, confidence)


def walk(table: ScoreTable, sampling, rng) -> Walk:
    """The round's walk for ``sampling`` (a SamplingParams): greedy at temperature 0, else
    sampled with ``table.num_rows`` uniforms drawn from ``rng`` (a numpy Generator)."""
    if sampling.is_greedy:
        return greedy_walk(table)
    if rng is None:
        raise ValueError("sampled DFlash2 drafting needs DraftRequest.rng (a numpy Generator)")
    return sampled_walk(table, sampling.temperature, rng.random(table.num_rows))


def _tokens(table: ScoreTable, indices: list[int]) -> list[int]:
    return [int(table.candidates[t, j]) for t, j in enumerate(indices)]
