"""speculant: lossless speculative decoding with pluggable drafters, verifiers and backends."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "GenerationStats", "validate", "__version__"]

if TYPE_CHECKING:
    from speculant.core.config import EngineConfig
    from speculant.core.engine import Engine
    from speculant.core.metrics import GenerationStats
    from speculant.core.validator import validate


def __getattr__(name: str):
    # Lazy, so `import speculant` stays cheap and never imports torch or mlx.
    if name == "Engine":
        from speculant.core.engine import Engine

        return Engine
    if name == "EngineConfig":
        from speculant.core.config import EngineConfig

        return EngineConfig
    if name == "GenerationStats":
        from speculant.core.metrics import GenerationStats

        return GenerationStats
    if name == "validate":
        from speculant.core.validator import validate

        return validate
    raise AttributeError(f"module 'speculant' has no attribute {name!r}")
