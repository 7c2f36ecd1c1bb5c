"""Typed errors. Each says what went wrong and how to fix it."""

from __future__ import annotations


class SpeculantError(Exception):
    """Base class of every error speculant raises on purpose."""


class ConfigError(SpeculantError):
    """A configuration file or value is malformed; ``field`` names the field when it is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class SettingError(ConfigError, ValueError):
    """A per-call argument of ``Engine.generate`` / ``Engine.run`` is invalid (a bad override,
    prompt or prompt_ids); ``field`` names the config field (or ``prompt`` / ``prompt_ids``)."""


class EngineBusyError(SpeculantError, RuntimeError):
    """The engine is already generating (another thread, or another generator still open).

    One engine serves one request at a time: close or exhaust the first generator, or give
    each thread its own engine."""


class ValidationFailed(SpeculantError):
    """A model pairing failed the compatibility checks; ``problems`` lists all of them."""

    def __init__(self, problems: list) -> None:
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"the engine configuration has {len(problems)} problem(s):\n{lines}")


class PluginError(SpeculantError):
    """A plugin failed to load, clashed with another, or is missing."""


class CheckpointError(SpeculantError):
    """A checkpoint's tensors are missing, unexpected or mis-shaped; ``field`` names the config
    field that points at it (``target.path``) when known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class GenerationError(SpeculantError):
    """Generation stopped early; ``token_ids`` holds what was produced before it stopped."""

    def __init__(self, message: str, token_ids: list[int] | None = None) -> None:
        super().__init__(message)
        self.token_ids = list(token_ids or [])


class NonFiniteLogitsError(GenerationError):
    """The target produced NaN or infinite logits."""


class ContextTooLongError(SpeculantError):
    """The prompt plus requested tokens exceed the model's context window."""
