"""A module wrapped in place of an mlx-lm module, to which attribute reads fall through."""

from __future__ import annotations

import mlx.nn as nn


class Wrapper(nn.Module):
    """Holds ``module``; attributes the wrapper lacks are read from it, so model code that
    inspects its layers (``layer.use_sliding`` in mlx-lm's Llama, ``conv1d.weight``) still works."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def __getattr__(self, key: str):
        try:
            return super().__getattr__(key)
        except AttributeError:
            wrapped = self.get("module")
            if wrapped is None:
                raise
            return getattr(wrapped, key)
