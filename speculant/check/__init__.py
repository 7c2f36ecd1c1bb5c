"""``speculant check``: prove a pairing exact on your own prompts.

Two checks, on the engine a config describes and the same loaded target decoding plainly:

- **greedy** (``greedy.py``): the speculative engine's tokens equal plain greedy decoding token
  for token, on every prompt; a difference is reported with its first position and the text
  around it. In bfloat16/float16 a difference within the dtype's rounding of the target's logits
  is a near-tie, a warning (``ties.py``); ``--strict`` counts warnings as failures.
- **sampling** (``sampling.py``, at a temperature > 0): a chi-square test of the first tokens
  against the target's exact processed distribution.

A check that could not have failed (no draft verified, no prefix with enough samples) is
reported as inconclusive and exits non-zero, never as ok.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from speculant.check.greedy import GreedyResult, check_greedy
from speculant.check.sampling import MIN_GROUP, SamplingResult, check_sampling, chi_square, chi_square_sf
from speculant.core.types import SamplingParams

__all__ = ["GreedyResult", "SamplingResult", "check_greedy", "check_sampling", "chi_square", "chi_square_sf",
           "add_parser", "cmd_check"]

LOW_PRECISION = ("bfloat16", "float16")
REPEATABLE = ("in {dtype} a verify block and a one-token step round differently, so output depends on the "
              "verify widths, which the adaptive verifier changes from request to request: the same greedy "
              "request may give different text. --dtype float32 makes it exact and repeatable; a fixed verify "
              "width (--verifier auto) makes it repeatable")


# -- command line ---------------------------------------------------------------------------
def add_parser(sub: Any, parents: list[argparse.ArgumentParser], add_override_flags: Any) -> None:
    p = sub.add_parser("check", parents=parents, help="prove a pairing exact: speculative vs plain decoding",
                       description="Greedy output of the speculative engine vs plain decoding of the same target "
                                   "on N prompts, and at a temperature > 0 a chi-square test of the first tokens "
                                   "against the target's processed distribution. Exit 1 on any failure or an "
                                   "inconclusive test; near-ties in bfloat16/float16 are warnings (exit 0).")
    p.add_argument("--config", metavar="FILE", help="engine config (.toml, .yaml, .json); flags override it")
    p.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help="prompts: one per line, or JSONL / JSON with 'prompt' fields")
    p.add_argument("-n", "--num-prompts", type=int, default=8, metavar="N", help="prompts to check (default 8)")
    p.add_argument("--samples", type=int, default=400, metavar="N",
                   help=f"generations for the sampling test (default 400, at least {MIN_GROUP})")
    p.add_argument("--sample-tokens", type=int, default=3, metavar="N",
                   help="first tokens tested for their distribution (default 3)")
    p.add_argument("--alpha", type=float, default=0.001, help="significance level of the sampling test, in (0, 1)")
    p.add_argument("--strict", action="store_true", help="count near-ties (warnings) as failures")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    add_override_flags(p)
    p.set_defaults(func=cmd_check)


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse settings under which a check tests nothing, before any weights load."""
    from speculant.cli_settings import UsageError

    if args.num_prompts < 1:
        raise UsageError(f"-n/--num-prompts: must be at least 1, got {args.num_prompts}")
    if args.samples < MIN_GROUP:
        raise UsageError(f"--samples: must be at least {MIN_GROUP} (a prefix needs {MIN_GROUP} samples before "
                         f"its next token is tested), got {args.samples}")
    if args.sample_tokens < 1:
        raise UsageError(f"--sample-tokens: must be at least 1, got {args.sample_tokens}")
    if not 0.0 < args.alpha < 1.0:
        raise UsageError(f"--alpha: a significance level between 0 and 1 (exclusive), e.g. 0.001; got {args.alpha}")


def cmd_check(args: argparse.Namespace) -> int:
    from speculant.cli_settings import UsageError, build_config, load_registry
    from speculant.api import load_engine

    check_arguments(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = 64
    config = build_config(args)
    prompts = read_prompts(args)[: args.num_prompts]
    engine = load_engine(config, registry=load_registry(args))
    if not engine.speculative:
        raise UsageError("check compares speculative with plain decoding: give a drafter or --lookup")
    greedy = check_greedy(engine, prompts, config.generation.max_new_tokens)
    sampling = None
    s = config.sampling
    if s.temperature > 0:
        params = SamplingParams(s.temperature, s.top_p, s.top_k)
        sampling = check_sampling(engine, prompts[0], args.samples, params, args.sample_tokens, args.alpha)
    verdict = Verdict(greedy, sampling, engine.backend.dtype_name, args.strict)
    if args.json:
        print(json.dumps({"ok": verdict.ok, "failures": verdict.failures, "warnings": verdict.warnings,
                          "inconclusive": verdict.inconclusive, "dtype": verdict.dtype,
                          "greedy": [asdict(r) for r in greedy], "sampling": asdict(sampling) if sampling else None},
                         indent=2))
    else:
        print_results(greedy, sampling, engine.tokenizer)
        print(verdict.summary())
    return 0 if verdict.ok else 1


class Verdict:
    """What the results add up to: failures, near-tie warnings, and whether anything was tested."""

    def __init__(self, greedy: list[GreedyResult], sampling: SamplingResult | None, dtype: str, strict: bool) -> None:
        self.dtype, self.strict = dtype, strict
        self.failures = sum(not r.ok for r in greedy) + int(sampling is not None and not sampling.ok
                                                            and not sampling.inconclusive)
        self.warnings = sum(len(r.near_ties) for r in greedy)
        reasons = []
        if not any(r.drafted_tokens for r in greedy):
            reasons.append("no drafted token was verified, so the greedy check compared plain decoding with itself")
        if sampling is not None and sampling.inconclusive:
            reasons.append(f"no prefix drew {MIN_GROUP} samples over two tokens or more, so the sampling test had "
                           "nothing to test: raise --samples or the temperature")
        self.inconclusive = reasons

    @property
    def ok(self) -> bool:
        return not self.failures and not self.inconclusive and not (self.strict and self.warnings)

    def summary(self) -> str:
        lines = [f"INCONCLUSIVE: {reason}" for reason in self.inconclusive]
        if self.dtype in LOW_PRECISION:
            lines.append(f"note: {REPEATABLE.format(dtype=self.dtype)}")
        if self.failures or (self.strict and self.warnings):
            counted = self.failures + (self.warnings if self.strict else 0)
            lines.append(f"FAILED: {counted} check(s)" + (" (near-ties count as failures: --strict)" if self.strict
                                                          and self.warnings else ""))
        elif not self.inconclusive:
            lines.append("ok: the pairing is exact on these prompts" if not self.warnings else
                         f"ok with {self.warnings} warning(s): the pairing is exact on these prompts but for "
                         f"near-ties within {self.dtype} rounding")
        return "\n".join(lines)


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
    if not isinstance(items, list):
        raise UsageError(f"--prompts: {path} must hold a list of prompts")
    if any(isinstance(item, dict) and not isinstance(item.get("prompt"), str) for item in items):
        raise UsageError(f"--prompts: {path}: every object needs a \"prompt\" string")
    prompts = [item["prompt"] if isinstance(item, dict) else str(item) for item in items]
    if not prompts:
        raise UsageError(f"--prompts: {path} holds no prompt")
    return prompts


def print_results(greedy: list[GreedyResult], sampling: SamplingResult | None, tokenizer: Any) -> None:
    def show(t):
        return "(none)" if t is None else (repr(tokenizer.decode([t])) if tokenizer else str(t))

    for r in greedy:
        for tie in r.near_ties:
            print(f"prompt {r.prompt_index + 1}: warning: new token {tie['position']} {_tie_text(tie)}: plain "
                  f"{show(tie['plain_token'])}, speculative {show(tie['speculative_token'])}; continuing from "
                  "plain's token")
        if r.ok:
            but = f" but for {len(r.near_ties)} near-tie(s)" if r.near_ties else ""
            print(f"prompt {r.prompt_index + 1}: identical{but} ({r.new_tokens} tokens, "
                  f"mean acceptance length {r.mean_acceptance_length:.2f})")
        else:
            evidence = f": {r.evidence}" if r.evidence else ""
            print(f"prompt {r.prompt_index + 1}: DIFFERS at new token {r.first_difference}: plain "
                  f"{show(r.plain_token)}, speculative {show(r.speculative_token)}, after {r.context!r}{evidence}")
    if sampling is not None:
        verdict = ("inconclusive" if sampling.inconclusive else
                   "consistent with the target" if sampling.ok else "NOT the target's distribution")
        print(f"sampling (T={sampling.temperature}, top_p={sampling.top_p}, top_k={sampling.top_k}): first "
              f"{sampling.tokens} tokens of {sampling.samples} runs, {sampling.groups_tested} prefixes tested, "
              f"chi-square {sampling.chi_square:.1f} on {sampling.degrees_of_freedom} dof, "
              f"p = {sampling.p_value:.4g} (alpha {sampling.alpha}): {verdict}")


def _tie_text(tie: dict) -> str:
    return (f"near-tie (margin {tie['plain_margin']:.4g}, within {tie['dtype']} rounding {tie['bound']:.3g}; "
            f"block forward margin {tie['block_margin']:.4g})")
