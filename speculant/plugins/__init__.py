"""Plugin system: pluggy hookspecs, entry-point discovery and the registry."""

from speculant.plugins.hookspecs import hookimpl, hookspec
from speculant.plugins.manager import Registry, get_registry

__all__ = ["hookimpl", "hookspec", "Registry", "get_registry"]
