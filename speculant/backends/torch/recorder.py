"""Forward hooks that keep the hidden states a drafter asks for (``Capture``) from a PyTorch target."""

from __future__ import annotations

import torch

from speculant.core.types import Capture


class Recorder:
    """Forward hooks that keep only the requested layers' outputs, only while recording."""

    def __init__(self, layers: torch.nn.ModuleList, norm: torch.nn.Module) -> None:
        self.active: dict[int, torch.Tensor] | None = None
        self.wanted: set = set()
        for index, layer in enumerate(layers):
            layer.register_forward_hook(self._hook(index))
        norm.register_forward_hook(self._hook("post_norm"))
        self.last_layer = len(layers) - 1

    def _hook(self, key):
        def store(module, args, output):
            if self.active is not None and key in self.wanted:
                self.active[key] = output[0] if isinstance(output, tuple) else output

        return store

    def start(self, capture: Capture) -> None:
        self.wanted = set(capture.layer_ids)
        if capture.final_hidden == "post_norm":
            self.wanted.add("post_norm")
        elif capture.final_hidden == "pre_norm":
            self.wanted.add(self.last_layer)
        self.active = {} if self.wanted else None

    def finish(self, capture: Capture, batched: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(features, final hidden) of the forward just run: of its one sequence ([rows, ...]), or,
        ``batched``, of every sequence in it ([batch, rows, ...])."""
        got, self.active = self.active or {}, None
        pick = (lambda t: t) if batched else (lambda t: t[0])
        features = None
        if capture.layer_ids:
            features = torch.cat([pick(got[i]) for i in capture.layer_ids], dim=-1)
        final = None
        if capture.final_hidden is not None:
            final = pick(got["post_norm" if capture.final_hidden == "post_norm" else self.last_layer])
        return features, final
