"""``mx.compile`` for the target's forwards, where it is correct, and the ``backend.compile`` choice.

What can be compiled: mlx-lm's caches keep their write position as a Python int and write with
slice assignment at it, and a compiled function bakes such ints in when it is traced (it traces
again only for new input shapes, dtypes or non-array arguments). A compiled forward over the
cache would therefore write every step at the first step's offset, so the attention part stays
eager. What holds no state is each decoder layer's feed-forward block (MLP or MoE): it is
compiled per input shape, i.e. once per verify width (1 for plain steps, ``w`` for a block), with
the layer's weights captured as constants (a target's weights never change after loading).
mlx-lm already compiles its activations (``swiglu``), so what is gained is the fusion of the
projections' element-wise neighbours and fewer graph nodes per step.

The choice (``backend.compile``): ``off`` never compiles; ``on`` compiles wherever it can;
``auto`` compiles only where it was measured to pay. On the CPU (benchmarks/fast_path.py,
docs/fast-path.md) it did not, so ``auto`` stays eager there; on Metal it has not been measured
yet, so ``auto`` stays eager there too until it is.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from speculant.backends.mlx.wrapper import Wrapper

# Devices on which compiled feed-forward blocks were measured to pay (none yet: docs/fast-path.md).
PAYS_ON: frozenset[str] = frozenset()


class CompiledBlock(Wrapper):
    """Calls ``module`` through ``mx.compile`` (one trace per input shape)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.compiled = mx.compile(module.__call__)

    def __call__(self, x: mx.array) -> mx.array:
        return self.compiled(x)


def feed_forwards(layers: list) -> list[tuple[nn.Module, str]]:
    """(owner, attribute) of each decoder layer's feed-forward block (mlx-lm names it ``mlp``,
    ``feed_forward`` or ``block_sparse_moe``), looking through tap wrappers."""
    found = []
    for layer in layers:
        real = layer.get("module", layer) if isinstance(layer, Wrapper) else layer
        for name in ("mlp", "feed_forward", "block_sparse_moe"):
            if isinstance(real.get(name), nn.Module):
                found.append((real, name))
                break
    return found


def apply(layers: list, setting: str, device: str, weights: str | None = None) -> str:
    """Compile what ``setting`` asks for on ``device``; returns the ``fast_path`` description,
    ending with ``weights`` (what was done to the weights' layout) when given."""
    pipelined = "plain greedy steps pipelined (async_eval)" + (f"; {weights}" if weights else "")
    if setting == "off":
        return f"mlx: eager forwards (backend.compile=off); {pipelined}"
    if setting == "auto" and device not in PAYS_ON:
        return (f"mlx: eager forwards (backend.compile=auto: compiled feed-forward blocks were not measured to "
                f"pay on {device}); {pipelined}")
    blocks = feed_forwards(layers)
    if not blocks:
        return f"mlx: eager forwards (no feed-forward block found to compile); {pipelined}"
    for owner, name in blocks:
        if not isinstance(owner[name], CompiledBlock):
            setattr(owner, name, CompiledBlock(owner[name]))
    return f"mlx: feed-forward blocks of {len(blocks)}/{len(layers)} layers compiled (mx.compile per width); {pipelined}"
