"""``mx.compile`` for the target's forwards, and the ``backend.compile`` choice.

The whole forward is compiled over caches whose write position is an array (static.py): one
trace per (width, buffer rows), and the draft step follows
(``speculant/drafters/dflash/mlx_compiled.py``). Where the load-time check refuses that (a model
whose attention code reads the offset as an int), only each decoder layer's feed-forward block
(MLP or MoE), which holds no state, can be compiled: once per input shape, with the layer's
weights captured as constants.

The choice (``backend.compile``): ``off`` never compiles; ``on`` compiles wherever it can;
``auto`` compiles only where it was measured to pay. On the CPU the whole forward pays
(docs/history/fast-path-history.md) and the feed-forward blocks alone did not; on Metal neither has been
measured yet, so ``auto`` stays eager there until it is.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from speculant.backends.mlx.wrapper import Wrapper

# Devices on which compiled feed-forward blocks were measured to pay (none yet: docs/history/fast-path-history.md).
PAYS_ON: frozenset[str] = frozenset()
# Devices on which the whole compiled forward (static.py) was measured to pay.
WHOLE_PAYS_ON: frozenset[str] = frozenset({"cpu"})


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


def apply(layers: list, setting: str, device: str, weights: str | None = None,
          whole: Callable[[], tuple[bool, str]] | None = None) -> str:
    """Compile what ``setting`` asks for on ``device``; returns the ``fast_path`` description,
    ending with ``weights`` (what was done to the weights' layout) when given. ``whole`` compiles
    the whole forward where the target allows it (static.py) and says what it did or why not;
    the feed-forward blocks are compiled where it could not."""
    pipelined = "plain greedy steps pipelined (async_eval)" + (f"; {weights}" if weights else "")
    if setting == "off":
        return f"mlx: eager forwards (backend.compile=off); {pipelined}"
    if setting == "auto" and device not in WHOLE_PAYS_ON:
        return (f"mlx: eager forwards (backend.compile=auto: compiled forwards were not measured to "
                f"pay on {device}); {pipelined}")
    why_not = ""
    if whole is not None:
        done, note = whole()
        if done:
            return f"mlx: whole forwards compiled (mx.compile per width and cache capacity; {note}); {pipelined}"
        why_not = f"; whole forward not compiled: {note}"
    if setting == "auto" and device not in PAYS_ON:
        return (f"mlx: eager forwards (backend.compile=auto: compiled feed-forward blocks were not measured to "
                f"pay on {device}{why_not}); {pipelined}")
    blocks = feed_forwards(layers)
    if not blocks:
        return f"mlx: eager forwards (no feed-forward block found to compile{why_not}); {pipelined}"
    for owner, name in blocks:
        if not isinstance(owner[name], CompiledBlock):
            setattr(owner, name, CompiledBlock(owner[name]))
    return (f"mlx: feed-forward blocks of {len(blocks)}/{len(layers)} layers compiled (mx.compile per width"
            f"{why_not}); {pipelined}")
