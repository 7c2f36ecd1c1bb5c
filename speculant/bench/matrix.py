"""Expanding a :class:`BenchConfig` into cells, each keyed by a stable hash.

A cell is one point of the matrix. Plain cells (drafter ``none``) collapse the block size,
verifier and quantization axes. The key hashes everything that decides a cell's result
(settings, measurement protocol, model folder fingerprints, prompt texts), so a resumed run
reuses a finished cell only when it would be measured the same way again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from speculant.bench.config import BackendPoint, BenchConfig, DrafterPoint, SamplingPoint, TargetPoint, WorkloadSpec
from speculant.bench.workloads import load_workload, parse_context_length, prompts_digest, resolve_context_lengths
from speculant.core.errors import ConfigError


class Cell(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    target: str
    target_name: str
    backend: BackendPoint
    drafter: str  # kind, or "none"
    draft_path: str | None
    drafter_options: dict = {}
    block_size: int | None  # None = the draft's trained block
    verifier: str
    tree_budget: int | None = None  # the tree verifier's budget (B) and width (K); None for other verifiers
    tree_width: int | None = None
    quantization: str
    sampling: SamplingPoint
    context: str  # as requested ("0", "4k", "25%")
    context_tokens: int  # resolved prompt length to build (0 = bare prompt)
    context_scaled: bool = False
    max_new_tokens: int
    workload: str

    @property
    def is_plain(self) -> bool:
        return self.drafter == "none"

    @property
    def label(self) -> str:
        head = "plain" if self.is_plain else f"{self.drafter} b{self.block_size or 'trained'}"
        verifier = self.verifier if self.tree_budget is None else f"tree B{self.tree_budget} K{self.tree_width}"
        extra = [] if self.is_plain else [x for x in (verifier if self.verifier != "auto" else "",
                                                       "" if self.quantization == "off" else self.quantization) if x]
        ctx = f"ctx {self.context_tokens}" if self.context_tokens else "bare prompt"
        return " | ".join([self.workload, head, *extra, self.sampling.label, ctx, f"{self.max_new_tokens} new",
                           self.backend.label])

    @property
    def plain_key(self) -> str:
        """Cells with the same plain baseline share this value."""
        fields = self.model_dump(include={"target", "backend", "sampling", "context_tokens", "max_new_tokens", "workload"})
        return _digest(fields)


def expand(config: BenchConfig, fingerprints: dict[str, str] | None = None) -> tuple[list[Cell], list[str]]:
    """All cells in run order, and notes (e.g. context lengths scaled to a window)."""
    if not config.targets:
        raise ConfigError("no target: give target = \"MODEL_DIR\" in the config or --target")
    m = config.matrix
    fingerprints = fingerprints or {}
    notes: list[str] = []
    protocol = config.model_dump(include={"repeats", "warmup", "warmup_tokens", "prompts_per_workload", "seed",
                                          "ignore_eos"})
    digests = {w.name: prompts_digest(load_workload(w.name, w.path, w.prompts)) for w in m.workloads}
    cells: list[Cell] = []
    seen: set[str] = set()
    for target, backend, drafter, quant in itertools.product(config.targets, m.backends, m.drafters, m.quantization):
        window = _window(target.path)
        plain = not drafter.enabled
        draft = None if plain else config.drafter_path(drafter)
        blocks = [None] if plain else m.block_sizes
        verifiers = ["auto"] if plain else m.verifiers
        quant = "off" if plain else quant
        for block, (verifier, tree), sampling, max_new, workload in itertools.product(
                blocks, _verifier_points(verifiers, m), m.sampling, m.max_new_tokens, m.workloads):
            lengths = resolve_context_lengths(m.context_lengths, window, max_new, config.context_fit)
            for requested, tokens in lengths.items():
                if tokens is None:
                    _note(notes, f"context length {requested} does not fit {target.label}'s window of {window} "
                                 f"with {max_new} new tokens: skipped")
                    continue
                scaled = _was_scaled(requested, tokens)
                if scaled:
                    _note(notes, f"context lengths scaled to fit {target.label}'s window of {window} with "
                                 f"{max_new} new tokens ({requested} -> {tokens} tokens)")
                cell = _cell(target, backend, drafter, draft, block, verifier, quant, sampling, requested, tokens,
                             scaled, max_new, workload).model_copy(update=tree)
                key = cell_key(cell, protocol, fingerprints, digests[workload.name])
                if key not in seen:
                    seen.add(key)
                    cells.append(cell.model_copy(update={"key": key}))
    return cells, notes


def _verifier_points(verifiers: list[str], m) -> list[tuple[str, dict]]:
    """Each verifier; the ``tree`` verifier once per (budget, width) of the tree axes."""
    points: list[tuple[str, dict]] = []
    for verifier in verifiers:
        if verifier == "tree":
            points += [(verifier, {"tree_budget": b, "tree_width": w})
                       for b, w in itertools.product(m.tree_budgets, m.tree_widths)]
        else:
            points.append((verifier, {}))
    return points


def _cell(target: TargetPoint, backend: BackendPoint, drafter: DrafterPoint, draft: Path | None, block, verifier,
          quant, sampling: SamplingPoint, requested: str, tokens: int, scaled: bool, max_new: int,
          workload: WorkloadSpec) -> Cell:
    return Cell(
        key="", target=str(target.path), target_name=target.label, backend=backend,
        drafter=drafter.kind if drafter.enabled else "none", draft_path=None if draft is None else str(draft),
        drafter_options=dict(drafter.options), block_size=block, verifier=verifier, quantization=quant,
        sampling=sampling, context=requested, context_tokens=tokens, context_scaled=scaled, max_new_tokens=max_new,
        workload=workload.name,
    )


def cell_key(cell: Cell, protocol: dict, fingerprints: dict[str, str], prompts: str) -> str:
    unset = {f for f in ("tree_budget", "tree_width") if getattr(cell, f) is None}  # keys of older runs stay
    params = cell.model_dump(exclude={"key", "target_name", "context_scaled", *unset})
    models = {p: fingerprints.get(p) for p in (cell.target, cell.draft_path) if p}
    return _digest({"cell": params, "protocol": protocol, "models": models, "prompts": prompts})


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _window(path: Path) -> int | None:
    try:
        data = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # reported by validation when the cell runs
    data = {**data, **data["text_config"]} if isinstance(data.get("text_config"), dict) else data
    window = data.get("max_position_embeddings")
    return window if isinstance(window, int) else None


def _was_scaled(requested: str, tokens: int) -> bool:
    text = requested.strip()
    if text.endswith("%"):
        return False
    return parse_context_length(int(text) if text.isdigit() else text).tokens != tokens


def _note(notes: list[str], text: str) -> None:
    if text not in notes:
        notes.append(text)
