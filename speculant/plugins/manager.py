"""Discover plugins through entry points and collect what they register.

Each plugin's hooks are called separately so every registered name records its source;
a duplicate name is an error naming both sources; a plugin that fails to import is
recorded (with its traceback) and the others keep working.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import pluggy

from speculant.core.errors import PluginError
from speculant.plugins import hookspecs

ENTRY_POINT_GROUP = "speculant"

# Built-ins are ordinary entry points of this distribution; this tuple is the fallback when
# speculant runs from a source tree that was never pip-installed (no entry-point metadata).
BUILTIN_PLUGINS = (
    ("torch", "speculant.backends.torch.plugin"),
    ("mlx", "speculant.backends.mlx.plugin"),
    ("dflash", "speculant.drafters.dflash.plugin"),
    ("verifiers", "speculant.verifiers.plugin"),
)


@dataclass
class PluginRecord:
    name: str
    distribution: str
    version: str
    module: str
    location: str | None = None
    status: str = "loaded"  # loaded | failed | blocked
    error: str | None = None
    traceback: str | None = None
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


class Registry:
    """Everything the installed plugins registered, with where each came from."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("speculant")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginRecord] = []
        self.backends: dict[str, Any] = {}
        self.drafters: dict[str, Any] = {}
        self.verifiers: dict[str, Any] = {}
        self._origin: dict[tuple[str, str], str] = {}

    # -- discovery -------------------------------------------------------------------------
    def load(self, extra_modules: tuple[str, ...] = ()) -> "Registry":
        allow = _env_list("SPECULANT_LOAD_PLUGINS")
        block = set(_env_list("SPECULANT_DISABLE_PLUGINS") or [])
        seen_modules: set[str] = set()
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist else "unknown"
            version = ep.dist.version if ep.dist else "?"
            builtin = dist == "speculant"
            record = PluginRecord(ep.name, "builtin" if builtin else dist, version, ep.value)
            if ep.value in seen_modules:
                continue
            seen_modules.add(ep.value)
            if not builtin and ((allow is not None and dist not in allow and ep.name not in allow) or ep.name in block or dist in block):
                record.status = "blocked"
                self.plugins.append(record)
                continue
            self._load_module(record)
        for name, module in BUILTIN_PLUGINS:
            if module not in seen_modules:
                seen_modules.add(module)
                self._load_module(PluginRecord(name, "builtin", _own_version(), module))
        for module in extra_modules:
            if module not in seen_modules:
                self._load_module(PluginRecord(module, "command line", "-", module))
        return self

    def _load_module(self, record: PluginRecord) -> None:
        self.plugins.append(record)
        try:
            module = importlib.import_module(record.module)
            record.location = getattr(module, "__file__", None)
            self.pm.register(module, name=f"{record.distribution}:{record.name}")
            self.pm.check_pending()
        except Exception as exc:  # a broken plugin must not take the others down
            record.status = "failed"
            record.error = f"{type(exc).__name__}: {exc}"
            record.traceback = traceback.format_exc()
            return
        record.hooks = sorted(
            impl.name for impl in self.pm.get_hookcallers(module) or []
        )
        source = record.distribution if record.distribution != "builtin" else f"builtin ({record.name})"
        source = f"{source} {record.version}" if record.distribution not in ("builtin", "command line") else source
        try:
            for hook, table in (
                ("register_backends", self.backends),
                ("register_drafters", self.drafters),
                ("register_verifiers", self.verifiers),
            ):
                impl = getattr(module, hook, None)
                if impl is None:
                    continue
                kind = hook.removeprefix("register_")
                impl(register=self._registrar(kind, table, source, record))
        except Exception as exc:
            record.status = "failed"
            record.error = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__} while registering: {exc}"
            record.traceback = traceback.format_exc()
            self._unregister(record)

    def _unregister(self, record: PluginRecord) -> None:
        """Take back everything a failed plugin registered, so it is all-or-nothing."""
        for kind, names in record.registered.items():
            for name in names:
                getattr(self, kind).pop(name, None)
                self._origin.pop((kind, name), None)
        record.registered = {}
        try:
            self.pm.unregister(name=f"{record.distribution}:{record.name}")
        except Exception:
            pass

    def _registrar(self, kind: str, table: dict, source: str, record: PluginRecord):
        def register(obj: Any) -> None:
            name = getattr(obj, "name", None)
            if not isinstance(name, str) or not name:
                raise PluginError(f"{source} registered a {kind[:-1]} without a string `name`: {obj!r}")
            if name in table:
                raise PluginError(
                    f"duplicate {kind[:-1]} name {name!r}: registered by {self._origin[(kind, name)]} "
                    f"and by {source}; uninstall or disable one (SPECULANT_DISABLE_PLUGINS)"
                )
            table[name] = obj
            self._origin[(kind, name)] = source
            record.registered.setdefault(kind, []).append(name)

        return register

    # -- lookups ---------------------------------------------------------------------------
    def origin(self, kind: str, name: str) -> str:
        return self._origin.get((kind, name), "unknown")

    def failed_plugins(self) -> list[PluginRecord]:
        return [p for p in self.plugins if p.status == "failed"]

    def missing_hint(self, kind: str, name: str) -> str:
        known = ", ".join(sorted(getattr(self, kind))) or "none"
        failed = self.failed_plugins()
        hint = f"no {kind[:-1]} named {name!r} is registered (available: {known})"
        if failed:
            hint += "; plugins that failed to load: " + "; ".join(f"{p.distribution}:{p.name} ({p.error})" for p in failed)
        return hint

    def check_pairing(self, config, target, drafter) -> list:
        problems = []
        for impl_result in self.pm.hook.check_pairing(config=config, target=target, drafter=drafter):
            problems.extend(impl_result or [])
        return problems


def _entry_points():
    try:
        return list(md.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # pragma: no cover - broken metadata
        return []


def _own_version() -> str:
    try:
        return md.version("speculant")
    except md.PackageNotFoundError:
        return "source"


def _env_list(name: str) -> list[str] | None:
    value = os.environ.get(name)
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


_REGISTRY: Registry | None = None


def get_registry(refresh: bool = False) -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry().load()
    return _REGISTRY
