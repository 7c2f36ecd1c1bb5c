"""Prompt sets and context building: built-in prompts, prompt files, prompts padded to a length.

Prompt files: ``.jsonl`` (one object per line with ``prompt``, ``text``, ``question`` or
``turns``, or a bare string), ``.json`` (a list of the same), ``.txt`` / ``.md`` (the whole
file is one prompt, or several separated by lines holding only ``---``), or a folder of such
files.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from speculant.core.errors import ConfigError

BUILTIN_WORKLOADS: dict[str, list[str]] = {
    "code": [
        "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals "
        "and returns them sorted. Include a docstring and type hints.\n\n```python\n",
        "Implement an LRU cache class in Python with `get(key)` and `put(key, value)` in O(1) time, "
        "using a dict and a doubly linked list.\n\n```python\n",
        "Write a function that parses a CSV line with quoted fields (commas and escaped quotes inside "
        "quotes) into a list of strings, without using the csv module.\n\n```python\n",
        "Write a Python generator `primes()` that yields prime numbers forever using an incremental "
        "sieve, then print the first 20 primes.\n\n```python\n",
        "Write a binary search function `bisect_left(a, x)` for a sorted list and unit tests for it "
        "with pytest, covering empty lists and duplicates.\n\n```python\n",
        "Refactor this function to be iterative:\n\ndef depth(node):\n    if node is None:\n        return 0\n"
        "    return 1 + max(depth(node.left), depth(node.right))\n\n```python\n",
    ],
    "math": [
        "A train travels 180 km in 2.5 hours, then 120 km in 1.5 hours. What is its average speed for "
        "the whole trip? Please reason step by step, and put your final answer within \\boxed{}.",
        "Find all real x such that x^2 - 5x + 6 = 0. Please reason step by step, and put your final "
        "answer within \\boxed{}.",
        "How many positive divisors does 360 have? Please reason step by step, and put your final "
        "answer within \\boxed{}.",
        "The sum of three consecutive even integers is 78. What is the largest? Please reason step by "
        "step, and put your final answer within \\boxed{}.",
    ],
    "chat": [
        "Explain the difference between a process and a thread to a new programmer.",
        "Give me three tips for writing clear commit messages.",
        "What are the trade-offs between SQL and NoSQL databases?",
        "Summarise how HTTPS protects data in transit.",
    ],
}

# Neutral filler for padding prompts to a context length: source-like text, so code prompts
# stay in distribution. Repeated as needed.
FILLER = "\n".join(BUILTIN_WORKLOADS["code"]).replace("```python\n", "") + (
    "\n# utilities\n"
    "def clamp(value, low, high):\n    return max(low, min(high, value))\n\n"
    "def chunks(items, size):\n    for start in range(0, len(items), size):\n        yield items[start:start + size]\n\n"
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
    "    def add(self, key):\n        self.counts[key] = self.counts.get(key, 0) + 1\n\n"
)

_CONTEXT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kK])?\s*$")


@dataclass(frozen=True)
class ContextLength:
    """A requested context length: absolute tokens, or a fraction of the model's window."""

    tokens: int | None = None
    fraction: float | None = None
    text: str = "0"


def parse_context_length(value: int | str) -> ContextLength:
    """``0`` (the bare prompt), ``4096``, ``"4k"``, or ``"25%"`` of the window left after the new tokens."""
    if isinstance(value, bool):
        raise ValueError("a context length must be a number of tokens, '4k' or '25%'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("a context length cannot be negative")
        return ContextLength(tokens=value, text=str(value))
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ValueError(f"cannot parse context length {value!r}") from None
        if not 0 < pct <= 100:
            raise ValueError(f"context length {value!r} must be a percentage in (0, 100]")
        return ContextLength(fraction=pct / 100, text=text)
    match = _CONTEXT_RE.match(text)
    if not match:
        raise ValueError(f"cannot parse context length {value!r}; use tokens (4096), '4k' or '25%'")
    tokens = float(match.group(1)) * (1024 if match.group(2) else 1)
    return ContextLength(tokens=int(tokens), text=text)


def resolve_context_lengths(values: Sequence[int | str], window: int | None, max_new_tokens: int,
                            fit: str = "scale") -> dict[str, int | None]:
    """Map each requested length to a token count for one model and ``max_new_tokens``.

    Percentages are of the room left in the window. Absolute lengths that do not fit beside the
    new tokens are, with ``fit="scale"``, all scaled by one factor (keeping their ratios, as the
    4K/8K/16K/32K protocol does on smaller windows); with ``fit="skip"`` they map to None.
    """
    parsed = {str(v): parse_context_length(v) for v in values}
    room = None if window is None else max(0, window - max_new_tokens - 1)
    absolute = [c.tokens for c in parsed.values() if c.tokens]
    factor = 1.0
    if room is not None and absolute and max(absolute) > room and fit == "scale":
        factor = room / max(absolute)
    out: dict[str, int | None] = {}
    for key, c in parsed.items():
        if c.fraction is not None:
            out[key] = None if room is None else int(room * c.fraction)
        elif room is not None and c.tokens > room and fit != "scale":
            out[key] = None
        else:
            out[key] = int(c.tokens * factor)
    return out


def load_workload(name: str, path: Path | None, inline: list[str] | None) -> list[str]:
    if inline:
        return list(inline)
    if path is None:
        if name not in BUILTIN_WORKLOADS:
            raise ConfigError(f"unknown built-in workload {name!r} (built-ins: {', '.join(BUILTIN_WORKLOADS)}); "
                              "give a prompt file path instead")
        return list(BUILTIN_WORKLOADS[name])
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in (".txt", ".md", ".jsonl", ".json"))
        prompts = [p for f in files for p in _read_prompt_file(f)]
    elif path.is_file():
        prompts = _read_prompt_file(path)
    else:
        raise ConfigError(f"workload {name!r}: prompt file {path} does not exist")
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise ConfigError(f"workload {name!r}: {path} holds no prompts")
    return prompts


def _read_prompt_file(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"prompt file {path} is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); convert it first, e.g. iconv -t UTF-8") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            return [_prompt_of(json.loads(line), path) for line in text.splitlines() if line.strip()]
        if suffix == ".json":
            data = json.loads(text)
            return [_prompt_of(item, path) for item in (data if isinstance(data, list) else [data])]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"cannot parse prompt file {path}: {exc}") from None
    parts = re.split(r"(?m)^---\s*$", text)
    return [p.strip("\n") for p in parts]


def _prompt_of(item: Any, path: Path) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        for key in ("prompt", "text", "question", "instruction", "input"):
            if isinstance(item.get(key), str):
                return item[key]
        turns = item.get("turns")
        if isinstance(turns, list) and turns and isinstance(turns[0], str):
            return turns[0]
    raise ConfigError(f"{path}: each entry needs a 'prompt' (or text/question/turns) string, got {str(item)[:80]!r}")


def prompts_digest(prompts: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(prompts)).encode()).hexdigest()[:16]


def build_prompt_ids(tokenizer: Any, prompt: str, context_tokens: int, chat_template: bool | None) -> list[int]:
    """Token ids of ``prompt``, preceded by filler so the total is ``context_tokens`` (when longer)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
    missing = context_tokens - len(ids)
    if missing <= 0:
        return list(ids)
    return filler_ids(tokenizer, missing) + list(ids)


def filler_ids(tokenizer: Any, n: int) -> list[int]:
    unit = tokenizer.encode(FILLER, add_special_tokens=False)
    if not unit:
        raise ConfigError("the tokenizer encodes the filler text to nothing; cannot pad prompts")
    reps = n // len(unit) + 1
    return (unit * reps)[:n]
