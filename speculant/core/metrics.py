"""Per-generation statistics."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# The public field set; ``--json`` prints exactly these.
PUBLIC_FIELDS = (
    "ttft_s",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "total_s",
    "new_tokens",
    "acceptance_lengths",
    "mean_acceptance_length",
    "per_position_acceptance",
    "verify_steps",
    "lookup_steps",
    "lookup_acceptance_length",
    "peak_memory_bytes",
    "stop_reason",
    "dtype",
    "dtype_reason",
    "target",
    "cached_tokens",
    "prefix_cache_hits",
    "prefix_cache_bytes",
)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # leading prompt tokens restored from the prefix cache, not prefilled
    prefix_cache_bytes: int = 0  # what the engine's prefix cache held in memory when the request ended
    prefix_cache_hits: int = 0  # requests of this engine resumed from it so far, this one included
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    verify_steps: int = 0
    lookup_steps: int = 0  # cycles that verified a prompt-lookup copy instead of a drafter proposal
    lookup_emitted: int = 0
    drafts_ahead: int = 0  # next-cycle drafts made before a verification was read (draft_ahead)
    drafts_ahead_kept: int = 0  # of those, the ones whose block was accepted whole, so used
    peak_memory_bytes: int | None = None
    stop_reason: str = "unknown"  # eos | stop_token | stop_string | max_new_tokens | context_length | interrupted | cancelled | error
    submitted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Time inside target forwards and drafter calls, for the overhead benchmark; measured only
    # when ``phases_timed`` (Engine.time_phases, or a verifier that needs timings), else 0.
    target_s: float = 0.0
    draft_s: float = 0.0
    phases_timed: bool = False
    verifier: dict = field(default_factory=dict)
    fast_path: str = "eager"  # what ran compiled (widths, compile seconds), or why it stayed eager
    draft_fast_path: str | None = None  # the same for the drafter's forwards (None: no drafter)
    dtype: str = ""  # what the target ran in (float32, bfloat16, ...)
    dtype_reason: str = ""  # why: "auto: CPU", "set by backend.dtype", ...
    target: str = ""  # the target's name (target_name)
    batched_cycles: int = 0  # cycles verified in one forward beside other requests (core/scheduler.py)
    batch_note: str | None = None  # why this request could not speculate while batched, if so
    # moves between the target's own cache and a batch row: caches copied, or rebuilt by a prefill
    cache_moves: int = 0
    cache_rebuilds: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (TTFT excluded)."""
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 and self.new_tokens > 1 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Rate at which the draft token at block position j+1 was accepted when submitted."""
        return [acc / sub if sub else 0.0 for acc, sub in zip(self.accepted_per_position, self.submitted_per_position)]

    @property
    def lookup_acceptance_length(self) -> float:
        """Mean tokens emitted per prompt-lookup cycle (0 when there were none)."""
        return self.lookup_emitted / self.lookup_steps if self.lookup_steps else 0.0

    def record_cycle(self, submitted: int, accepted: int, emitted: int, copied: bool = False) -> None:
        self.verify_steps += 1
        if copied:
            self.lookup_steps += 1
            self.lookup_emitted += emitted
        self.acceptance_lengths.append(emitted)
        while len(self.submitted_per_position) < submitted:
            self.submitted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(submitted):
            self.submitted_per_position[j] += 1
            if j < accepted:
                self.accepted_per_position[j] += 1

    @property
    def overhead_s(self) -> float | None:
        """Decode time spent outside target and draft forwards (None when they were not timed)."""
        if not self.phases_timed:
            return None
        return max(0.0, self.decode_s - self.target_s - self.draft_s)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in PUBLIC_FIELDS}

    def full_dict(self) -> dict:
        data = asdict(self)
        data.update(self.as_dict())
        return data

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def __str__(self) -> str:
        tau = f", mean acceptance length {self.mean_acceptance_length:.2f}" if self.acceptance_lengths else ""
        return (
            f"{self.new_tokens} tokens, TTFT {self.ttft_s * 1000:.0f} ms, prefill {self.prefill_tokens_per_s:.1f} tok/s, "
            f"decode {self.decode_tokens_per_s:.1f} tok/s{tau}, {self.verify_steps} verify steps{self._lookup_text()}, "
            f"stop: {self.stop_reason}{self._dtype_text()}{self._cached_text()}"
        )

    def _dtype_text(self) -> str:
        return f", dtype {self.dtype} ({self.dtype_reason})" if self.dtype else ""

    def _cached_text(self) -> str:
        if not self.cached_tokens:
            return ""
        return (f", {self.cached_tokens} of {self.prompt_tokens} prompt tokens from the prefix cache "
                f"({self.prefix_cache_hits} hits, {self.prefix_cache_bytes / 2**20:.1f} MiB held)")

    def _lookup_text(self) -> str:
        if not self.lookup_steps:
            return ""
        return f" ({self.lookup_steps} copies by prompt lookup, {self.lookup_acceptance_length:.2f} tokens each)"


def target_name(path: str | Path) -> str:
    """A target's name from its folder: the repository id of a Hugging Face cache snapshot
    (``models--Qwen--Qwen3-8B/snapshots/<hash>``), the shipped pair's, else the folder's name."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    if parts[-3:] == ("embedded", "pair", "target"):
        return "speculant shipped pair (qwen3)"
    return parts[-1] if parts else str(path)
