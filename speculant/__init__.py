"""speculant: lossless speculative decoding with pluggable drafters, verifiers and backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "GenerationStats", "load_engine", "load_pair", "validate", "__version__"]

if TYPE_CHECKING:
    from speculant.api import load_engine, validate
    from speculant.core.config import EngineConfig
    from speculant.core.engine import Engine
    from speculant.core.metrics import GenerationStats
    from speculant.pairs import load_pair

_LAZY = {
    "Engine": "speculant.core.engine",
    "EngineConfig": "speculant.core.config",
    "GenerationStats": "speculant.core.metrics",
    "load_engine": "speculant.api",
    "load_pair": "speculant.pairs",
    "validate": "speculant.api",
}


def __getattr__(name: str):
    # Lazy, so `import speculant` stays cheap and never imports torch or mlx.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'speculant' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(module), name)
