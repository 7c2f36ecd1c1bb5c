"""Everything a plugin author imports. Import from here, not from speculant's internal modules,
which may move; what this module exports keeps its name.

A plugin is a module (or object) whose ``@hookimpl`` functions are named after the hooks in
:mod:`speculant.plugins.hookspecs`, listed in its ``pyproject.toml`` under the entry-point group
:data:`ENTRY_POINT_GROUP`::

    [project.entry-points.speculant]
    toy = "speculant_toy_drafter"

    # speculant_toy_drafter/__init__.py
    from speculant.plugin_api import hookimpl

    @hookimpl
    def register_drafters(register):
        register(ToyDrafterFactory())

What a plugin provides, and what the engine hands it:

- **roles**: :class:`Backend` (with its :class:`TargetModel`), :class:`DrafterFactory` (which
  ``describe``s a checkpoint before weights load, then ``load``s a :class:`Drafter`), and
  :class:`Verifier`. Arrays are opaque backend values, handled through :class:`ArrayOps`
  (``backend.ops``); :class:`NumpyOps` runs a verifier on host arrays in unit tests.
- **values**: :class:`TargetInfo` / :class:`DrafterInfo` (facts read before weights load),
  :class:`DraftRequest` -> :class:`Draft` -> :class:`Verification`, :class:`ForwardOutput` and
  :class:`Capture` (target logits and hidden states), :class:`SamplingParams`,
  :class:`CycleTiming`, :class:`ProposalKind`, :class:`DraftSource`.
- **checks**: a :class:`Problem` names the config field, what is wrong and the fix
  (``severity="warning"`` does not stop the engine); ``check_pairing`` hooks return lists of them,
  and :class:`Report` is what ``speculant validate`` collects.
- **config**: the sections a factory or a check receives (:class:`EngineConfig`,
  :class:`DrafterConfig`, :class:`VerifierConfig`, :class:`BackendConfig`). A plugin's own
  options are a pydantic model set as ``options_model``; ``drafter.options`` /
  ``verifier.options`` are validated against it (unknown keys are errors).
- **checkpoints**: :func:`tensor_inventory`, :func:`read_safetensors_header`,
  :func:`safetensors_files` and :func:`compare_inventory` read safetensors headers without
  loading weights, for ``describe``.
- **errors**: raise :class:`CheckpointError` for bad weights and :class:`ConfigError` for bad
  settings (both carry the config ``field``), and :class:`NonFiniteLogitsError` from a verifier or
  a target's greedy steps when the logits are NaN or infinite.

docs/plugins.md describes each hook, how plugins are found and switched off, and a worked
third-party drafter.
"""

from __future__ import annotations

import pluggy

from speculant.core.arrays import ArrayOps, NumpyOps
from speculant.core.checkpoint import compare_inventory, read_safetensors_header, safetensors_files, tensor_inventory
from speculant.core.config import BackendConfig, DrafterConfig, EngineConfig, VerifierConfig
from speculant.core.errors import CheckpointError, ConfigError, NonFiniteLogitsError, PluginError, SpeculantError
from speculant.core.interfaces import Backend, Drafter, DrafterFactory, TargetModel, Verifier
from speculant.core.problems import Problem, Report
from speculant.core.types import (
    Array,
    Capture,
    CycleTiming,
    Draft,
    DrafterInfo,
    DraftRequest,
    DraftSource,
    ForwardOutput,
    ProposalKind,
    SamplingParams,
    TargetInfo,
    Verification,
)

ENTRY_POINT_GROUP = "speculant"
"""The entry-point group (and pluggy project name) speculant discovers plugins under."""

hookimpl = pluggy.HookimplMarker(ENTRY_POINT_GROUP)
"""Marks a plugin function (or method) as the implementation of the hook of the same name."""

__all__ = [
    "ENTRY_POINT_GROUP", "hookimpl",
    # roles
    "ArrayOps", "Backend", "Drafter", "DrafterFactory", "NumpyOps", "TargetModel", "Verifier",
    # values
    "Array", "Capture", "CycleTiming", "Draft", "DrafterInfo", "DraftRequest", "DraftSource", "ForwardOutput",
    "ProposalKind", "SamplingParams", "TargetInfo", "Verification",
    # checks and config
    "Problem", "Report", "BackendConfig", "DrafterConfig", "EngineConfig", "VerifierConfig",
    # checkpoints
    "compare_inventory", "read_safetensors_header", "safetensors_files", "tensor_inventory",
    # errors
    "CheckpointError", "ConfigError", "NonFiniteLogitsError", "PluginError", "SpeculantError",
]
