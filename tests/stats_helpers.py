"""Shared statistics for the sampling-losslessness tests: an independent NumPy reference of the
target distribution and a chi-square goodness-of-fit test."""

from __future__ import annotations

import numpy as np

from speculant.check import chi_square_sf
from speculant.check.sampling import pooled_bins


def reference_probs(logits, temperature, top_k=0, top_p=1.0):
    """Plain NumPy float64: temperature, keep the k largest, softmax, smallest top-p set, renormalise."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    if 0 < top_k < z.size:
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        n_keep = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        kept = np.zeros_like(p)
        kept[order[:n_keep]] = p[order[:n_keep]]
        p = kept / kept.sum()
    return p


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution (the one ``speculant check`` uses)."""
    return chi_square_sf(stat, df)


def gof_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of categorical samples against ``probs``; 0 if an impossible cell occurs.
    Rare cells are pooled as ``speculant check`` pools them (``pooled_bins``)."""
    probs = probs.ravel()
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    if counts[probs <= 0].sum() > 0:
        return 0.0
    n = counts.sum()
    obs, exp = pooled_bins(counts[probs > 0], probs[probs > 0] * n)
    if obs.size < 2:
        return 1.0
    try:
        from scipy.stats import chisquare
    except ImportError:
        stat = float(((obs - exp) ** 2 / exp).sum())
        return chi2_sf(stat, obs.size - 1)
    return float(chisquare(obs, exp * (obs.sum() / exp.sum())).pvalue)
