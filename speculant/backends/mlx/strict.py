"""Strict target loading on MLX: mlx-lm already refuses missing, unexpected and mis-shaped
tensors (``load_weights(strict=True)``); its ValueError becomes a CheckpointError naming them."""

from __future__ import annotations

import contextlib
from typing import Iterator

from speculant.core.errors import CheckpointError


@contextlib.contextmanager
def checkpoint_errors(path: str) -> Iterator[None]:
    """Turn the loader's complaints about the checkpoint's tensors into a CheckpointError."""
    try:
        yield
    except ValueError as exc:
        detail = " ".join(str(exc).split())  # mlx lists the names one per line
        raise CheckpointError(f"target.path: checkpoint {path} does not match the model its config.json "
                              f"describes: {detail}", "target.path") from None
    except RuntimeError as exc:
        if "safetensors" not in str(exc).lower():
            raise
        raise CheckpointError(f"target.path: checkpoint {path} is not readable: {exc}", "target.path") from None
