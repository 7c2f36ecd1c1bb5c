"""Measuring one cell: warm-up, then repeats of plain and speculative runs interleaved.

Within a repeat each prompt runs plain and speculative back to back, in an order that
alternates (ABBA) between prompts and repeats, so slow drift of the machine (thermal state,
other load) affects both sides alike. The plain engine shares the target with the speculative
one, in the same process.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from speculant.bench.config import BenchConfig
from speculant.bench.matrix import Cell
from speculant.bench.stats import tpot


@dataclass(frozen=True)
class PromptCase:
    index: int
    ids: list[int]


def call_settings(cell: Cell, config: BenchConfig, seed: int, max_new_tokens: int | None = None) -> dict[str, Any]:
    return {
        "max_new_tokens": max_new_tokens or cell.max_new_tokens,
        "temperature": cell.sampling.temperature,
        "top_p": cell.sampling.top_p,
        "top_k": cell.sampling.top_k,
        "seed": seed,
        "ignore_eos": config.ignore_eos,
    }


def run_seed(config: BenchConfig, repeat: int, prompt_index: int) -> int:
    return config.seed + 1000 * repeat + prompt_index


def tokens_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _run(engine, prompt: PromptCase, settings: dict[str, Any]):
    result = engine.run(prompt_ids=prompt.ids, **settings)
    if result.stats.stop_reason == "interrupted":  # the engine ends a generation on Ctrl-C and returns
        raise KeyboardInterrupt
    return result


def warm_up(cell: Cell, config: BenchConfig, prompts: list[PromptCase], plain, spec) -> None:
    n = min(config.warmup_tokens, cell.max_new_tokens)
    block = {} if cell.block_size is None else {"block_size": cell.block_size}
    for _ in range(config.warmup):
        _run(plain, prompts[0], call_settings(cell, config, config.seed, n))
        if spec is not None:
            _run(spec, prompts[0], {**call_settings(cell, config, config.seed, n), **block})


def measure_cell(cell: Cell, config: BenchConfig, prompts: list[PromptCase], plain, spec, attempt: str,
                 emit: Callable[[dict], None]) -> dict[int, list[int]]:
    """Run the cell's measured runs, calling ``emit`` with each run record (plain/spec pairs
    together); returns the plain output token ids of the first repeat, by prompt index."""
    block = {} if cell.block_size is None else {"block_size": cell.block_size}
    plain_tokens: dict[int, list[int]] = {}
    for repeat in range(config.repeats):
        for prompt in prompts:
            seed = run_seed(config, repeat, prompt.index)
            roles: list[tuple[str, Any]] = [("plain", plain)] + ([("spec", spec)] if spec is not None else [])
            if (repeat + prompt.index) % 2:
                roles.reverse()
            results = {}
            for order, (role, engine) in enumerate(roles):
                extra = block if role == "spec" else {}
                results[role] = (order, _run(engine, prompt, {**call_settings(cell, config, seed), **extra}))
            plain_tokens.setdefault(prompt.index, list(results["plain"][1].token_ids))
            records = {role: run_record(cell, config, attempt, role, repeat, prompt, order, result)
                       for role, (order, result) in results.items()}
            if "spec" in records:
                records["spec"]["block_size_used"] = cell.block_size or spec.block_size
                plain_ids, spec_ids = results["plain"][1].token_ids, results["spec"][1].token_ids
                records["spec"]["token_match"] = plain_ids == spec_ids if cell.sampling.is_greedy else None
                records["spec"]["first_mismatch"] = (first_mismatch(plain_ids, spec_ids)
                                                     if cell.sampling.is_greedy else None)
            for role in sorted(records, key=lambda r: records[r]["order"]):
                emit(records[role])
    return plain_tokens


def run_record(cell: Cell, config: BenchConfig, attempt: str, role: str, repeat: int, prompt: PromptCase, order: int,
               result) -> dict:
    stats = result.stats
    data = stats.full_dict()
    verifier = data.pop("verifier", None)
    record = {
        "type": "run", "cell": cell.key, "attempt": attempt, "role": role, "repeat": repeat,
        "prompt_index": prompt.index, "order": order, "seed": run_seed(config, repeat, prompt.index),
        "time": time.time(), **data,
        "tpot_s": tpot(stats.decode_s, stats.new_tokens),
        "tokens_sha": tokens_digest(result.token_ids),
    }
    if config.record_tokens:
        record["token_ids"] = list(result.token_ids)
    if cell.verifier == "tree" and role == "spec" and verifier:
        record["tree"] = verifier  # nodes verified, accepted depths, branches used, or why chains
    return record
