"""Benchmark arithmetic on run records (dicts as written to runs.jsonl).

Conventions (the DFlash papers' and reference benchmark's):

- decode time per token (TPOT) = decode time / tokens after the first; TTFT is excluded;
- a repeat's TPOT pools its prompts: sum of decode times / sum of tokens after the first;
- speed-up = plain TPOT / speculative TPOT, per repeat (plain and speculative runs of the same
  repeat ran interleaved in the same process), and the cell's figure is the median over repeats;
- mean acceptance length = mean over runs of each run's mean tokens per verify cycle
  (accepted + 1; the prefill token is not a cycle);
- per-position acceptance pools counts: accepted at position j / submitted at position j.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Iterable, Sequence


def tpot(decode_s: float, new_tokens: int) -> float | None:
    """Decode seconds per token after the first, or None when no decode happened."""
    if new_tokens < 2 or decode_s <= 0:
        return None
    return decode_s / (new_tokens - 1)


def pooled_tpot(runs: Iterable[dict]) -> float | None:
    decode = tokens = 0.0
    for r in runs:
        if r["new_tokens"] >= 2:
            decode += r["decode_s"]
            tokens += r["new_tokens"] - 1
    return decode / tokens if tokens and decode > 0 else None


def speedup(plain_tpot: float | None, spec_tpot: float | None) -> float | None:
    """plain decode time per token / speculative decode time per token."""
    if not plain_tpot or not spec_tpot:
        return None
    return plain_tpot / spec_tpot


def by_repeat(runs: Iterable[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for r in runs:
        out[r["repeat"]].append(r)
    return dict(sorted(out.items()))


def speedups_per_repeat(plain: Sequence[dict], spec: Sequence[dict], field: str = "decode") -> list[float]:
    """One speed-up per repeat present in both lists; ``field="total"`` compares end-to-end time."""
    p, s = by_repeat(plain), by_repeat(spec)
    out = []
    for rep in sorted(set(p) & set(s)):
        if field == "total":
            value = speedup(sum(r["total_s"] for r in p[rep]), sum(r["total_s"] for r in s[rep]))
        else:
            value = speedup(pooled_tpot(p[rep]), pooled_tpot(s[rep]))
        if value is not None:
            out.append(value)
    return out


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def repeat_median(runs: Sequence[dict], fn) -> float | None:
    """Median over repeats of ``fn(runs of that repeat)``."""
    return median(fn(group) for group in by_repeat(runs).values())


def decode_tokens_per_s(runs: Sequence[dict]) -> float | None:
    t = pooled_tpot(runs)
    return 1.0 / t if t else None


def prefill_tokens_per_s(runs: Sequence[dict]) -> float | None:
    prefill = sum(r["prefill_s"] for r in runs)
    tokens = sum(r["prompt_tokens"] for r in runs)
    return tokens / prefill if prefill > 0 else None


def mean_acceptance_length(runs: Sequence[dict]) -> float | None:
    means = [sum(r["acceptance_lengths"]) / len(r["acceptance_lengths"]) for r in runs if r["acceptance_lengths"]]
    return sum(means) / len(means) if means else None


def pooled_positions(runs: Iterable[dict]) -> tuple[list[int], list[int]]:
    submitted: list[int] = []
    accepted: list[int] = []
    for r in runs:
        for j, (s, a) in enumerate(zip(r["submitted_per_position"], r["accepted_per_position"])):
            if j >= len(submitted):
                submitted.append(0)
                accepted.append(0)
            submitted[j] += s
            accepted[j] += a
    return submitted, accepted


def rates(submitted: Sequence[int], accepted: Sequence[int]) -> list[float]:
    return [a / s if s else 0.0 for s, a in zip(submitted, accepted)]


def stop_reasons(runs: Iterable[dict]) -> dict[str, int]:
    return dict(Counter(r["stop_reason"] for r in runs))
