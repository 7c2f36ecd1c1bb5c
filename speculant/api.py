"""The composition root: the one place that loads plugins and assembles engines from config.

``core`` never reaches for the plugin manager: the validator and the engine are handed the parts
(and a :class:`~speculant.core.interfaces.Catalogue` of what plugins registered) from here. The
CLI, the benchmark, the server and the trainers build engines only through these functions.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Sequence

from speculant.core.config import BackendConfig, DrafterConfig, EngineConfig
from speculant.core.engine import Engine
from speculant.core.errors import ValidationFailed
from speculant.core.interfaces import Backend, Catalogue, Drafter, TargetModel, Verifier
from speculant.core.problems import Report
from speculant.core.validator import validate as validate_with
from speculant.drafters.lookup import LookupProposer
from speculant.plugins.manager import Registry, get_registry

ConfigSource = EngineConfig | dict | str | Path


def plugin_registry(extra_modules: Sequence[str] = ()) -> Registry:
    """The plugins installed now, plus ``extra_modules`` loaded by name (``-p``); a fresh registry,
    where ``load_engine`` and ``validate`` without one share the process-wide cached registry."""
    return Registry().load(extra_modules=tuple(extra_modules))


def validate(config: ConfigSource, registry: Catalogue | None = None) -> Report:
    """Check a pairing before any weights load: every problem at once, each naming field and fix."""
    return validate_with(config, registry if registry is not None else get_registry())


def load_engine(config: ConfigSource, registry: Catalogue | None = None, parts: "LoadedParts | None" = None) -> Engine:
    """Validate the pairing (no weights yet), then load the target and drafter into an engine.

    ``parts`` keeps loaded backends, the target and the drafter between calls (the benchmark
    builds many engines over one target); without it every call loads afresh."""
    registry = registry if registry is not None else get_registry()
    config = EngineConfig.load(config)
    report = validate_with(config, registry)
    if not report.ok:
        raise ValidationFailed(report.errors)
    return assemble(config, report, registry, parts)


def assemble(config: EngineConfig, report: Report, registry: Catalogue, parts: "LoadedParts | None" = None) -> Engine:
    """An engine from a validated config: backend, target, drafter (wrapped by prompt lookup when
    ``drafter.lookup`` is on) and verifier, its compiled forwards (if any) built before it returns."""
    parts = parts if parts is not None else LoadedParts(registry)
    backend = parts.backend(config.backend)
    target = parts.target(backend, str(config.target.path), report)
    drafter = parts.drafter(config.drafter, report, backend, target) if config.drafter.enabled else None
    if config.drafter.lookup.enabled:
        drafter = LookupProposer(drafter, config.drafter.lookup, backend)
    engine = Engine(config, backend, target, make_verifier(config, registry), drafter, report)
    engine.warm_up()
    return engine


def make_verifier(config: EngineConfig, registry: Catalogue) -> Verifier:
    """A fresh verifier of ``verifier.kind`` (``auto`` resolved by the config) with its options."""
    return registry.verifiers[config.verifier.resolved_kind](config.verifier.options)


class LoadedParts:
    """Loaded backends, target and drafter, reused while the next engine asks for the same ones.

    One target and one drafter stay loaded at a time (a new one drops the old first, so a
    benchmark over several targets never holds two); backends are kept per backend config."""

    def __init__(self, registry: Catalogue) -> None:
        self.registry = registry
        self._backends: dict[str, Backend] = {}
        self._target: tuple[tuple, TargetModel] | None = None
        self._drafter: tuple[tuple, Drafter] | None = None

    def backend(self, config: BackendConfig) -> Backend:
        key = config.model_dump_json()
        if key not in self._backends:
            self._backends[key] = self.registry.backends[config.kind](config)
        return self._backends[key]

    def target(self, backend: Backend, path: str, report: Report) -> TargetModel:
        key = (backend.config.model_dump_json(), path)
        if self._target is None or self._target[0] != key:
            self._drafter = self._target = None
            gc.collect()
            self._target = (key, backend.load_target(path, report.target))
        return self._target[1]

    def drafter(self, config: DrafterConfig, report: Report, backend: Backend, target: TargetModel) -> Drafter:
        # the block size and lookup are per-engine settings: the same loaded drafter serves them all
        key = (self._target[0] if self._target else None, config.model_dump_json(exclude={"block_size", "lookup"}))
        if self._drafter is None or self._drafter[0] != key:
            self._drafter = None
            gc.collect()
            factory = self.registry.drafters[config.kind]
            self._drafter = (key, factory.load(config, report.drafter, backend, target))
        return self._drafter[1]
