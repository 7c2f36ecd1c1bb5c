"""``speculant check``: prove a pairing exact on your own prompts.

Two checks, on the engine a config describes and the same loaded target decoding plainly:

- **greedy**: the speculative engine's tokens equal plain greedy decoding token for token, on
  every prompt; a difference is reported with its first position and the text around it;
- **sampling** (at a temperature > 0): the first ``tokens`` generated tokens follow the target's
  exact processed distribution (temperature, top-k, top-p). Samples are grouped by the tokens
  before each position; each group with enough samples is compared with the target's
  distribution after that prefix, computed by one plain target forward, in a chi-square test.
  Statistics and degrees of freedom add up over groups (they are independent), so the test
  gives one p-value. The first token comes from the prefill alone; the later ones pass through
  a draft, a verification and a rollback, which is what the check is for.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from speculant.core.types import SamplingParams

MIN_GROUP = 30  # samples a prefix needs before its next token is tested
MIN_EXPECTED = 5.0  # chi-square bins: tokens expected fewer times are pooled


@dataclass
class GreedyResult:
    prompt_index: int
    new_tokens: int
    first_difference: int | None  # index into the new tokens; None when identical
    plain_token: int | None = None
    speculative_token: int | None = None
    context: str = ""  # the text before the difference (its last 60 characters)
    mean_acceptance_length: float = 0.0

    @property
    def ok(self) -> bool:
        return self.first_difference is None


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
    def ok(self) -> bool:
        return self.degrees_of_freedom == 0 or self.p_value >= self.alpha


def check_greedy(engine: Any, prompts: Sequence[str | list[int]], max_new_tokens: int) -> list[GreedyResult]:
    """Speculative vs plain greedy decoding of ``engine``'s own target, prompt by prompt."""
    plain = engine.without_drafter()
    results = []
    for i, prompt in enumerate(prompts):
        kwargs = _prompt_kwargs(prompt)
        settings = dict(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        speculative = engine.run(**kwargs, **settings)
        reference = plain.run(**kwargs, **settings)
        results.append(_compare(i, engine.tokenizer, reference.token_ids, speculative.token_ids,
                                speculative.stats.mean_acceptance_length))
    return results


def _prompt_kwargs(prompt: str | list[int]) -> dict:
    return {"prompt_ids": list(prompt)} if isinstance(prompt, list) else {"prompt": prompt}


def _compare(index: int, tokenizer: Any, plain: list[int], speculative: list[int], tau: float) -> GreedyResult:
    n = min(len(plain), len(speculative))
    diff = next((j for j in range(n) if plain[j] != speculative[j]), None)
    if diff is None and len(plain) != len(speculative):
        diff = n
    result = GreedyResult(index, len(speculative), diff, mean_acceptance_length=tau)
    if diff is not None:
        result.plain_token = plain[diff] if diff < len(plain) else None
        result.speculative_token = speculative[diff] if diff < len(speculative) else None
        if tokenizer is not None:
            result.context = tokenizer.decode(plain[:diff])[-60:]
    return result


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
    kwargs = _prompt_kwargs(prompt)
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
    """Pearson statistic and degrees of freedom; rare tokens are pooled into one bin.

    A token drawn that the target gives probability 0 is an outright failure (infinite statistic)."""
    n = sum(counts.values())
    if any(probs[t] <= 0 for t in counts):
        return math.inf, 1
    expected = probs * n
    big = [t for t in np.flatnonzero(expected >= MIN_EXPECTED)]
    observed = [counts.get(int(t), 0) for t in big]
    bins = list(zip(observed, expected[big]))
    rest_expected = n - float(expected[big].sum())
    rest_observed = n - sum(observed)
    if rest_expected >= 1e-9 or rest_observed:
        bins.append((rest_observed, max(rest_expected, 1e-12)))
    if len(bins) < 2:
        return 0.0, 0
    return float(sum((o - e) ** 2 / e for o, e in bins)), len(bins) - 1


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


# -- command line ---------------------------------------------------------------------------
def add_parser(sub: Any, parents: list[argparse.ArgumentParser], add_override_flags: Any) -> None:
    p = sub.add_parser("check", parents=parents, help="prove a pairing exact: speculative vs plain decoding",
                       description="Greedy output of the speculative engine vs plain decoding of the same target "
                                   "on N prompts, and at a temperature > 0 a chi-square test of the first tokens "
                                   "against the target's processed distribution. Exit 1 on any failure.")
    p.add_argument("--config", metavar="FILE", help="engine config (.toml, .yaml, .json); flags override it")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="prompts: one per line, or JSONL / JSON with 'prompt' fields")
    p.add_argument("-n", "--num-prompts", type=int, default=8, metavar="N", help="prompts to check (default 8)")
    p.add_argument("--samples", type=int, default=400, metavar="N",
                   help="generations for the sampling test (default 400)")
    p.add_argument("--sample-tokens", type=int, default=3, metavar="N",
                   help="first tokens tested for their distribution (default 3)")
    p.add_argument("--alpha", type=float, default=0.001, help="significance level of the sampling test")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_override_flags(p)
    p.set_defaults(func=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    from speculant.cli_settings import build_config, load_registry
    from speculant.api import load_engine

    if args.max_new_tokens is None:
        args.max_new_tokens = 64
    config = build_config(args)
    engine = load_engine(config, registry=load_registry(args))
    if not engine.speculative:
        from speculant.cli_settings import UsageError

        raise UsageError("check compares speculative with plain decoding: give a drafter or --lookup")
    prompts = read_prompts(args)[: max(1, args.num_prompts)]
    greedy = check_greedy(engine, prompts, config.generation.max_new_tokens)
    sampling = None
    s = config.sampling
    if s.temperature > 0:
        params = SamplingParams(s.temperature, s.top_p, s.top_k)
        sampling = check_sampling(engine, prompts[0], args.samples, params, args.sample_tokens, args.alpha)
    ok = all(r.ok for r in greedy) and (sampling is None or sampling.ok)
    if args.json:
        print(json.dumps({"ok": ok, "greedy": [asdict(r) for r in greedy],
                          "sampling": asdict(sampling) if sampling else None}, indent=2))
    else:
        print_results(greedy, sampling, engine.tokenizer)
    return 0 if ok else 1


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    if args.prompts:
        return _prompt_file(Path(args.prompts))
    from speculant.bench.workloads import load_workload

    return load_workload("code", None, None)


def _prompt_file(path: Path) -> list[str]:
    from speculant.cli_settings import UsageError

    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"--prompts: cannot read {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--prompts: {path} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                         f"{exc.start}); convert it first, e.g. iconv -t UTF-8") from None
    try:
        if path.suffix == ".json":
            items = json.loads(text)
        elif path.suffix == ".jsonl":
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            items = [line for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        raise UsageError(f"--prompts: cannot parse {path} as {path.suffix[1:].upper()}: {exc}") from None
    prompts = [item["prompt"] if isinstance(item, dict) else str(item) for item in items]
    if not prompts:
        raise UsageError(f"--prompts: {path} holds no prompt")
    return prompts


def print_results(greedy: list[GreedyResult], sampling: SamplingResult | None, tokenizer: Any) -> None:
    out = sys.stdout
    for r in greedy:
        if r.ok:
            print(f"prompt {r.prompt_index + 1}: identical ({r.new_tokens} tokens, "
                  f"mean acceptance length {r.mean_acceptance_length:.2f})", file=out)
        else:
            def show(t):
                return "(none)" if t is None else (repr(tokenizer.decode([t])) if tokenizer else str(t))
            print(f"prompt {r.prompt_index + 1}: DIFFERS at new token {r.first_difference}: plain "
                  f"{show(r.plain_token)}, speculative {show(r.speculative_token)}, after {r.context!r}", file=out)
    if sampling is not None:
        verdict = "consistent with the target" if sampling.ok else "NOT the target's distribution"
        print(f"sampling (T={sampling.temperature}, top_p={sampling.top_p}, top_k={sampling.top_k}): first "
              f"{sampling.tokens} tokens of {sampling.samples} runs, {sampling.groups_tested} prefixes tested, "
              f"chi-square {sampling.chi_square:.1f} on {sampling.degrees_of_freedom} dof, "
              f"p = {sampling.p_value:.4g} (alpha {sampling.alpha}): {verdict}", file=out)
    failed = sum(not r.ok for r in greedy) + (0 if sampling is None or sampling.ok else 1)
    print("ok: the pairing is exact on these prompts" if not failed else f"FAILED: {failed} check(s)", file=out)
