"""The sampling check: at a temperature > 0, the first ``tokens`` generated tokens follow the
target's exact processed distribution (temperature, top-k, top-p). Samples are grouped by the
tokens before each position; each group with enough samples is compared with the target's
distribution after that prefix, computed by one plain target forward, in a chi-square test.
Statistics and degrees of freedom add up over groups (they are independent), so the test gives
one p-value. The first token comes from the prefill alone; the later ones pass through a draft,
a verification and a rollback, which is what the check is for.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speculant.core.types import SamplingParams

MIN_GROUP = 30  # samples a prefix needs before its next token is tested
MIN_EXPECTED = 5.0  # chi-square bins: tokens expected fewer times are pooled


@dataclass
class SamplingResult:
    temperature: float
    top_p: float
    top_k: int
    samples: int
    tokens: int
    groups_tested: int
    chi_square: float
    degrees_of_freedom: int
    p_value: float
    alpha: float
    per_position: dict[int, int] = field(default_factory=dict)  # position -> groups tested there

    @property
    def inconclusive(self) -> bool:
        """No prefix drew enough samples over two bins or more: the test could not have failed."""
        return self.degrees_of_freedom == 0

    @property
    def ok(self) -> bool:
        return not self.inconclusive and self.p_value >= self.alpha


def check_sampling(
    engine: Any,
    prompt: str | list[int],
    samples: int,
    sampling: SamplingParams,
    tokens: int = 3,
    alpha: float = 0.001,
) -> SamplingResult:
    """Chi-square test of the first ``tokens`` sampled tokens against the target's distribution."""
    if sampling.is_greedy:
        raise ValueError("the sampling check needs a temperature > 0")
    kwargs = {"prompt_ids": list(prompt)} if isinstance(prompt, list) else {"prompt": prompt}
    settings = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    max_new_tokens=tokens, ignore_eos=True)
    runs = [tuple(engine.run(**kwargs, seed=seed, **settings).token_ids) for seed in range(samples)]
    prompt_ids = kwargs.get("prompt_ids") or engine._prompt_ids(prompt, None)
    groups: dict[tuple[int, tuple[int, ...]], Counter] = defaultdict(Counter)
    for run in runs:
        for position in range(min(tokens, len(run))):
            groups[(position, run[:position])][run[position]] += 1
    stat, dof, per_position = 0.0, 0, Counter()
    for (position, prefix), counts in sorted(groups.items()):
        if sum(counts.values()) < MIN_GROUP:
            continue
        p = target_distribution(engine, list(prompt_ids) + list(prefix), sampling)
        s, d = chi_square(counts, p)
        stat, dof = stat + s, dof + d
        per_position[position] += 1 if d else 0
    p_value = chi_square_sf(stat, dof) if dof else 1.0
    return SamplingResult(sampling.temperature, sampling.top_p, sampling.top_k, samples, tokens,
                          sum(per_position.values()), stat, dof, p_value, alpha, dict(per_position))


def target_distribution(engine: Any, context: list[int], sampling: SamplingParams) -> np.ndarray:
    """The target's processed next-token distribution after ``context`` (one plain forward)."""
    from speculant.core.sampling import target_probs

    ops = engine.backend.ops
    engine.target.reset()
    logits = engine.target.prefill(context).logits[-1:]
    probs = ops.to_numpy(target_probs(ops, logits, sampling))[0].astype(np.float64)
    engine.target.reset()
    return probs / probs.sum()


def chi_square(counts: Counter, probs: np.ndarray) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom over :func:`pooled_bins`.

    A token drawn that the target gives probability 0 is an outright failure (infinite statistic)."""
    n = sum(counts.values())
    if any(probs[t] <= 0 for t in counts):
        return math.inf, 1
    observed = np.zeros(probs.size)
    for token, count in counts.items():
        observed[token] = count
    possible = probs > 0
    obs, exp = pooled_bins(observed[possible], probs[possible] * n)
    if obs.size < 2:
        return 0.0, 0
    return float(((obs - exp) ** 2 / exp).sum()), int(obs.size) - 1


def pooled_bins(observed: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chi-square bins: cells expected fewer than ``MIN_EXPECTED`` times pooled into one, and the
    least expected of the others added to that pool until it too reaches ``MIN_EXPECTED``. A pool
    left small inflates the statistic: one token of probability 1e-5 drawn once in 200 draws,
    pooled alone, adds about 500 and fails the check."""
    order = np.argsort(expected, kind="stable")
    observed, expected = observed[order], expected[order]
    cut = int(np.searchsorted(expected, MIN_EXPECTED))  # cells [0, cut) expect too few
    pooled = expected[:cut].sum()
    while 0 < cut < expected.size and pooled < MIN_EXPECTED:
        pooled += expected[cut]
        cut += 1
    if cut == 0:
        return observed, expected
    return (np.append(observed[:cut].sum(), observed[cut:]), np.append(pooled, expected[cut:]))


def chi_square_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularised upper incomplete gamma Q(dof/2, x/2)."""
    if math.isinf(x):
        return 0.0
    s, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_prefix = s * math.log(z) - z - math.lgamma(s)
    if z < s + 1:  # series for the lower function P, then Q = 1 - P
        term = total = 1.0 / s
        k = s
        while abs(term) > 1e-15 * abs(total):
            k += 1
            term *= z / k
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    # continued fraction for Q (Lentz)
    tiny = 1e-300
    b, c, d = z + 1.0 - s, 1.0 / tiny, 1.0 / (z + 1.0 - s)
    h = d
    for i in range(1, 10_000):
        an = -i * (i - s)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return min(1.0, math.exp(log_prefix) * h)
