"""The greedy check: the speculative engine's tokens equal plain greedy decoding of the same
target, token for token. In bfloat16 or float16 a difference is classified (``ties.py``): a
near-tie within the dtype's rounding is a warning, and the check continues from plain
decoding's token; anything else is a failure, reported with the evidence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from speculant.check.ties import Divergence, TargetCalls, classify


@dataclass
class GreedyResult:
    prompt_index: int
    new_tokens: int
    first_difference: int | None  # index into the new tokens of the first real failure; None when none
    plain_token: int | None = None
    speculative_token: int | None = None
    context: str = ""  # the text before the difference (its last 60 characters)
    mean_acceptance_length: float = 0.0
    drafted_tokens: int = 0  # drafted tokens the target verified: 0 means nothing was tested
    evidence: str = ""  # for a failure: both paths' margins against the dtype's rounding
    near_ties: list[dict] = field(default_factory=list)  # asdict(Divergence) of each warning

    @property
    def ok(self) -> bool:
        return self.first_difference is None


def check_greedy(engine: Any, prompts: Sequence[str | list[int]], max_new_tokens: int) -> list[GreedyResult]:
    """Speculative vs plain greedy decoding of ``engine``'s own target, prompt by prompt."""
    plain_engine = engine.without_drafter()
    settings = dict(temperature=0.0, ignore_eos=True)
    results = []
    for i, prompt in enumerate(prompts):
        ids = list(prompt) if isinstance(prompt, list) else engine._prompt_ids(prompt, None)
        plain = plain_engine.run(prompt_ids=ids, max_new_tokens=max_new_tokens, **settings).token_ids
        results.append(_check_prompt(engine, i, ids, plain, max_new_tokens, settings))
    return results


def _check_prompt(engine: Any, index: int, ids: list[int], plain: list[int], max_new_tokens: int,
                  settings: dict) -> GreedyResult:
    """Decode speculatively; at each near-tie go on from plain decoding's token, until the end or
    a real failure."""
    start, ties, emitted, cycles, drafted = 0, [], 0, 0, 0
    while True:
        calls = TargetCalls(engine)
        with calls.recording():
            run = engine.run(prompt_ids=ids + plain[:start], max_new_tokens=max_new_tokens - start, **settings)
        emitted, cycles = emitted + sum(run.stats.acceptance_lengths), cycles + len(run.stats.acceptance_lengths)
        drafted += sum(run.stats.submitted_per_position)
        speculative = plain[:start] + run.token_ids
        diff = _first_difference(plain, speculative)
        divergence = None
        if diff is not None and diff < min(len(plain), len(speculative)):
            divergence = classify(engine, ids, plain, calls, diff, speculative[diff])
        if divergence is None or not divergence.near_tie:
            break  # identical, or a real failure
        ties.append(divergence)
        start = diff + 1
        if start >= max_new_tokens:
            diff = None
            break
    result = GreedyResult(index, len(speculative), diff, mean_acceptance_length=emitted / cycles if cycles else 0.0,
                          drafted_tokens=drafted, near_ties=[asdict(t) for t in ties])
    if diff is not None:
        _describe_failure(result, engine.tokenizer, plain, speculative, divergence)
    return result


def _first_difference(plain: list[int], speculative: list[int]) -> int | None:
    n = min(len(plain), len(speculative))
    diff = next((j for j in range(n) if plain[j] != speculative[j]), None)
    return n if diff is None and len(plain) != len(speculative) else diff


def _describe_failure(result: GreedyResult, tokenizer: Any, plain: list[int], speculative: list[int],
                      divergence: Divergence | None) -> None:
    diff = result.first_difference
    result.plain_token = plain[diff] if diff < len(plain) else None
    result.speculative_token = speculative[diff] if diff < len(speculative) else None
    if tokenizer is not None:
        result.context = tokenizer.decode(plain[:diff])[-60:]
    if divergence is not None:
        result.evidence = divergence.describe()
