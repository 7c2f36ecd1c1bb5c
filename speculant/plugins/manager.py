"""Discover plugins through entry points and collect what they register.

Each plugin's hooks are called separately so every registered name records its source;
a duplicate name is an error naming both sources (the later plugin is marked failed and
everything it registered is taken back); a plugin that fails to import is recorded (with its
traceback) and the others keep working. Built-ins load first, so a third-party plugin can never
displace a built-in name.

Environment:

- ``SPECULANT_LOAD_PLUGINS``: comma-separated allow-list of third-party plugins (distribution
  or entry-point names); set but empty means built-ins only.
- ``SPECULANT_DISABLE_PLUGINS``: comma-separated block-list (distribution or entry-point names).

Built-ins are always loaded. Nothing here is module-global except the cache behind
:func:`get_registry`; tests build ``Registry().load()`` themselves.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import pluggy

from speculant.core.errors import PluginError
from speculant.plugins import hookspecs

ENTRY_POINT_GROUP = "speculant"
REGISTER_HOOKS = {"register_backends": "backends", "register_drafters": "drafters", "register_verifiers": "verifiers"}

# Built-ins are ordinary entry points of this distribution; this tuple is the fallback when
# speculant runs from a source tree that was never pip-installed (no entry-point metadata).
BUILTIN_PLUGINS = (
    ("torch", "speculant.backends.torch.plugin"),
    ("mlx", "speculant.backends.mlx.plugin"),
    ("dflash", "speculant.drafters.dflash.plugin"),
    ("mtp", "speculant.drafters.mtp.plugin"),
    ("dflash2", "speculant.drafters.dflash2.plugin"),
    ("verifiers", "speculant.verifiers.plugin"),
    ("quantization", "speculant.drafters.quantization"),
)


@dataclass
class PluginRecord:
    """One plugin as ``speculant plugins`` shows it."""

    name: str
    distribution: str  # "builtin", a distribution name, or "command line"
    version: str
    module: str
    location: str | None = None
    status: str = "loaded"  # loaded | failed | blocked
    error: str | None = None
    traceback: str | None = None
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.distribution}:{self.name}"

    @property
    def source(self) -> str:
        """How errors and ``Registry.origin`` name this plugin."""
        if self.distribution == "builtin":
            return f"builtin ({self.name})"
        if self.distribution == "command line":
            return f"command line ({self.module})"
        return f"{self.distribution} {self.version}"

    def as_dict(self) -> dict:
        return asdict(self)


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
    def load(self, extra_modules: tuple[str, ...] | list[str] = ()) -> "Registry":
        """Load built-ins, then allowed third-party entry points, then ``extra_modules``."""
        allow = _env_list("SPECULANT_LOAD_PLUGINS")
        block = set(_env_list("SPECULANT_DISABLE_PLUGINS") or [])
        seen: set[str] = set()
        builtin_eps, other_eps = [], []
        for ep in _entry_points():
            (builtin_eps if _dist_name(ep) == "speculant" else other_eps).append(ep)
        for ep in builtin_eps:
            if ep.value not in seen:
                seen.add(ep.value)
                self._import_and_add(PluginRecord(ep.name, "builtin", _dist_version(ep), ep.value))
        for name, module in BUILTIN_PLUGINS:
            if module not in seen:
                seen.add(module)
                self._import_and_add(PluginRecord(name, "builtin", _own_version(), module))
        for ep in sorted(other_eps, key=lambda e: (_dist_name(e), e.name)):
            if ep.value in seen:
                continue
            dist = _dist_name(ep)
            record = PluginRecord(ep.name, dist, _dist_version(ep), ep.value)
            if (allow is not None and not {dist, ep.name} & set(allow)) or {dist, ep.name} & block:
                record.status = "blocked"  # its code never runs (unless named in extra_modules)
                record.location = _dist_location(ep)
                self.plugins.append(record)
                continue
            seen.add(ep.value)
            self._import_and_add(record)
        for module in extra_modules:
            if module not in seen:
                seen.add(module)
                self._import_and_add(PluginRecord(module, "command line", "-", module))
        return self

    def add_plugin(self, plugin: Any, name: str, distribution: str = "command line", version: str = "-") -> PluginRecord:
        """Register an in-process plugin object (a module or an object with ``@hookimpl`` methods)."""
        record = PluginRecord(name, distribution, version, getattr(plugin, "__name__", type(plugin).__name__))
        self.plugins.append(record)
        self._add(plugin, record)
        return record

    def _import_and_add(self, record: PluginRecord) -> None:
        self.plugins.append(record)
        try:
            module = importlib.import_module(record.module)
        except (Exception, SystemExit) as exc:  # a broken plugin must not take the others down
            self._fail(record, f"{type(exc).__name__} while importing {record.module}: {exc}")
            return
        record.location = getattr(module, "__file__", None)
        self._add(module, record)

    def _add(self, plugin: Any, record: PluginRecord) -> None:
        try:
            self.pm.register(plugin, name=record.key)
            self.pm.check_pending()  # a misspelled hook name is an error, not silence
        except Exception as exc:
            self._fail(record, f"{type(exc).__name__} while registering hooks: {exc}")
            self._unregister(record)
            return
        record.hooks = sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or [])
        try:
            for hook, kind in REGISTER_HOOKS.items():
                for impl in getattr(self.pm.hook, hook).get_hookimpls():
                    if impl.plugin_name == record.key:
                        impl.function(register=self._registrar(kind, record))
        except Exception as exc:
            message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__} while registering: {exc}"
            self._fail(record, message)
            self._unregister(record)

    def _fail(self, record: PluginRecord, message: str) -> None:
        record.status = "failed"
        record.error = message
        record.traceback = traceback.format_exc()

    def _unregister(self, record: PluginRecord) -> None:
        """Take back everything a failed plugin registered, so it is all-or-nothing."""
        for kind, names in record.registered.items():
            for name in names:
                getattr(self, kind).pop(name, None)
                self._origin.pop((kind, name), None)
        record.registered = {}
        record.hooks = []
        if self.pm.has_plugin(record.key):
            self.pm.unregister(name=record.key)

    def _registrar(self, kind: str, record: PluginRecord):
        table = getattr(self, kind)
        source = record.source

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
        """Where a registered name came from, e.g. ``speculant-toy-drafter 0.1``."""
        return self._origin.get((kind, name), "unknown")

    def failed_plugins(self) -> list[PluginRecord]:
        return [p for p in self.plugins if p.status == "failed"]

    def missing_hint(self, kind: str, name: str) -> str:
        known = ", ".join(sorted(getattr(self, kind))) or "none"
        hint = f"no {kind[:-1]} named {name!r} is registered (available: {known})"
        failed = self.failed_plugins()
        if failed:
            hint += "; plugins that failed to load: " + "; ".join(f"{p.source} ({p.error})" for p in failed)
        blocked = [p for p in self.plugins if p.status == "blocked"]
        if blocked:
            hint += "; blocked plugins (SPECULANT_LOAD_PLUGINS / SPECULANT_DISABLE_PLUGINS): " + ", ".join(p.source for p in blocked)
        return hint

    def check_pairing(self, config, target, drafter) -> list:
        """Every plugin's extra problems; a check that raises becomes a problem naming its plugin."""
        from speculant.core.problems import Problem

        args = {"config": config, "target": target, "drafter": drafter}
        problems = []
        for impl in self.pm.hook.check_pairing.get_hookimpls():  # registration order
            try:
                result = impl.function(**{a: args[a] for a in impl.argnames})
            except Exception as exc:
                problems.append(Problem("plugins", f"the check_pairing hook of {impl.plugin_name} raised {type(exc).__name__}: {exc}",
                                        "report this to the plugin's authors, or disable it with SPECULANT_DISABLE_PLUGINS"))
                continue
            problems.extend(result or [])
        return problems


def _entry_points() -> list:
    try:
        return list(md.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # pragma: no cover - broken metadata
        return []


def _dist_name(ep) -> str:
    return ep.dist.name if ep.dist is not None else "unknown"


def _dist_version(ep) -> str:
    return ep.dist.version if ep.dist is not None else "?"


def _dist_location(ep) -> str | None:
    try:
        return str(ep.dist.locate_file("")) if ep.dist is not None else None
    except Exception:  # pragma: no cover
        return None


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
    """The process-wide registry, built on first use (pass ``refresh=True`` to rebuild)."""
    global _REGISTRY
    if _REGISTRY is None or refresh:
        _REGISTRY = Registry().load()
    return _REGISTRY
