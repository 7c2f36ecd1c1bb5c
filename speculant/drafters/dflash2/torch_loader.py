"""Load a published DFlash2 checkpoint into :class:`DFlash2Model` (safetensors only)."""

from __future__ import annotations

from speculant.core.checkpoint import tensor_inventory
from speculant.core.errors import CheckpointError
from speculant.drafters import quantization
from speculant.drafters.dflash.torch_loader import (
    follow_target,
    load_into,
    place_and_quantize,
)
from speculant.drafters.dflash2.checkpoint import CODEBOOKS, codebook_spelling


def load_torch_dflash2(config, info, backend, target):
    from speculant.drafters.dflash2.drafter import DFlash2Drafter
    from speculant.drafters.dflash2.torch import DFlash2Model, TorchDFlash2Network

    cfg = info.extra["config"]
    _, problems = codebook_spelling(tensor_inventory(config.path))
    if problems:
        raise CheckpointError("; ".join(str(p) for p in problems))
    model = DFlash2Model(cfg)
    load_into(model, config.path, rename={name + ".weight": name for name in CODEBOOKS})
    q = quantization.resolve(config.quantization)
    if q is not None and q.quantize_all:
        model.candidate_selector.codebooks_as_embeddings()
    network = TorchDFlash2Network(place_and_quantize(model, config, info, backend), target, backend)
    follow_target(network, config, info, backend, target)
    return DFlash2Drafter(network, info, backend)
