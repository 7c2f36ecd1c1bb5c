"""Engines for benchmark cells, built once per (backend, target, drafter) and reused.

The target is loaded once per backend and shared by the plain engine and every speculative
engine on it (they run one at a time), so a matrix over several drafters holds one copy of the
target weights. Only the current target and drafter stay loaded: cells arrive grouped by them.
"""

from __future__ import annotations

import gc
import importlib
from typing import Any

from speculant.bench.matrix import Cell
from speculant.core.config import EngineConfig
from speculant.core.engine import Engine, _make_verifier
from speculant.core.problems import Problem, Report
from speculant.core.validator import validate


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
    return EngineConfig.load(data)


class EnginePool:
    def __init__(self, registry: Any, threads: int | None = None) -> None:
        self.registry = registry
        self.threads = threads
        self._backends: dict[str, Any] = {}
        self._target: tuple[tuple, Any] | None = None
        self._drafter: tuple[tuple, Any] | None = None
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
        backend = self._backend(cell)
        target = self._load_target(cell, backend, report)
        plain_cfg = engine_config(cell, speculative=False)
        plain = Engine(plain_cfg, backend, target, _make_verifier(plain_cfg, self.registry), None, report)
        if cell.is_plain:
            return plain, None
        spec_cfg = engine_config(cell, speculative=True)
        drafter = self._load_drafter(cell, spec_cfg, backend, target, report)
        return plain, Engine(spec_cfg, backend, target, _make_verifier(spec_cfg, self.registry), drafter, report)

    def _backend(self, cell: Cell):
        key = cell.backend.model_dump_json()
        if key not in self._backends:
            cfg = engine_config(cell, speculative=False).backend
            backend = self.registry.backends[cfg.kind](cfg)
            if self.threads and cfg.kind == "torch":
                # by name: the bench package keeps no import of an array library (see the CLI contract)
                importlib.import_module("torch").set_num_threads(self.threads)
            self._backends[key] = backend
            self.devices[cell.backend.label] = backend.device
        return self._backends[key]

    def _load_target(self, cell: Cell, backend, report: Report):
        key = (cell.backend.model_dump_json(), cell.target)
        if self._target is None or self._target[0] != key:
            self._drafter = None
            self._target = None
            gc.collect()
            self._target = (key, backend.load_target(cell.target, report.target))
        return self._target[1]

    def _load_drafter(self, cell: Cell, config: EngineConfig, backend, target, report: Report):
        key = (cell.backend.model_dump_json(), cell.target, cell.drafter, cell.draft_path, cell.quantization,
               repr(sorted(cell.drafter_options.items())))
        if self._drafter is None or self._drafter[0] != key:
            self._drafter = None
            gc.collect()
            factory = self.registry.drafters[cell.drafter]
            self._drafter = (key, factory.load(config.drafter, report.drafter, backend, target))
        return self._drafter[1]
