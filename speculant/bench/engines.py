"""Engines for benchmark cells, built once per (backend, target, drafter) and reused.

The target is loaded once per backend and shared by the plain engine and every speculative
engine on it (they run one at a time), so a matrix over several drafters holds one copy of the
target weights. Only the current target and drafter stay loaded: cells arrive grouped by them.
"""

from __future__ import annotations

from typing import Any

from speculant.bench.matrix import Cell
from speculant.core.config import EngineConfig
from speculant.api import LoadedParts, assemble, validate
from speculant.core.engine import Engine
from speculant.core.problems import Problem, Report


class CellSkipped(Exception):
    """The cell's configuration fails validation (e.g. a block size above the trained one)."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def engine_config(cell: Cell, speculative: bool) -> EngineConfig:
    data: dict[str, Any] = {
        "backend": cell.backend.model_dump(),
        "target": {"path": cell.target},
        "sampling": cell.sampling.model_dump(),
        "generation": {"max_new_tokens": cell.max_new_tokens},
    }
    if speculative and not cell.is_plain:
        data["drafter"] = {
            "kind": cell.drafter, "path": cell.draft_path, "block_size": cell.block_size,
            "quantization": None if cell.quantization == "off" else cell.quantization,
            "options": cell.drafter_options,
        }
        data["verifier"] = {"kind": cell.verifier}
        if cell.tree_budget is not None:
            data["verifier"]["options"] = {"budget": cell.tree_budget, "width": cell.tree_width}
    return EngineConfig.load(data)


class EnginePool:
    """The engines of each cell, assembled by the composition root over parts it keeps loaded."""

    def __init__(self, registry: Any, threads: int | None = None) -> None:
        self.registry = registry
        self.threads = threads
        self.parts = LoadedParts(registry)
        self.devices: dict[str, str] = {}

    def check(self, cell: Cell) -> Report:
        """Validate the plain and (for drafter cells) speculative configs; raise CellSkipped."""
        report = validate(engine_config(cell, speculative=True), self.registry)
        if not report.ok:
            raise CellSkipped(report.errors)
        return report

    def engines(self, cell: Cell) -> tuple[Engine, Engine | None]:
        """(plain engine, speculative engine or None for a plain cell)."""
        report = self.check(cell)
        plain = assemble(engine_config(cell, speculative=False), report, self.registry, self.parts)
        self._note_backend(cell, plain.backend)
        if cell.is_plain:
            return plain, None
        return plain, assemble(engine_config(cell, speculative=True), report, self.registry, self.parts)

    def _note_backend(self, cell: Cell, backend) -> None:
        if cell.backend.label in self.devices:
            return
        if self.threads and backend.name == "torch":
            import torch

            torch.set_num_threads(self.threads)
        self.devices[cell.backend.label] = backend.device
