"""The hooks a speculant plugin can implement (entry-point group ``speculant``).

A plugin is a module with functions decorated ``@speculant.plugin_api.hookimpl`` whose names
match the specs below. Built-in backends, drafters and verifiers use exactly these hooks.
"""

from __future__ import annotations

import pluggy

from speculant.plugin_api import hookimpl  # noqa: F401  (re-exported: the marker plugins use)

hookspec = pluggy.HookspecMarker("speculant")


@hookspec
def register_backends(register):
    """Register Backend subclasses by calling ``register(BackendClass)``."""


@hookspec
def register_drafters(register):
    """Register drafters by calling ``register(DrafterFactory instance)``."""


@hookspec
def register_verifiers(register):
    """Register Verifier subclasses by calling ``register(VerifierClass)``."""


@hookspec
def check_pairing(config, target, drafter):
    """Return a list of Problems for an EngineConfig, TargetInfo and DrafterInfo (or None) before weights load."""
