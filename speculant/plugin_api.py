"""Everything a plugin author imports: the ``hookimpl`` marker, the four roles, and the values
that flow between them. Import from here, not from speculant's internal modules, which may move.

A plugin is a module (or object) whose ``@hookimpl`` functions are named after the hooks in
:mod:`speculant.plugins.hookspecs`, listed under the ``speculant`` entry-point group. See
docs/plugins.md for each hook and a worked third-party drafter.
"""

from __future__ import annotations

import pluggy

from speculant.core.arrays import ArrayOps
from speculant.core.config import BackendConfig, DrafterConfig, EngineConfig, VerifierConfig
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

hookimpl = pluggy.HookimplMarker("speculant")

__all__ = [
    "hookimpl",
    "Array", "ArrayOps", "Backend", "BackendConfig", "Capture", "CycleTiming", "Draft", "Drafter", "DrafterConfig",
    "DrafterFactory", "DrafterInfo", "DraftRequest", "DraftSource", "EngineConfig", "ForwardOutput", "Problem",
    "ProposalKind", "Report", "SamplingParams", "TargetInfo", "TargetModel", "Verification", "Verifier",
    "VerifierConfig",
]
