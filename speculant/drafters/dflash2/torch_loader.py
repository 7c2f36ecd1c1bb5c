"""Load a published DFlash2 checkpoint into :class:`DFlash2Model` (safetensors only)."""

from __future__ import annotations

from speculant.core.checkpoint import tensor_inventory
from speculant.core.errors import CheckpointError
from speculant.drafters.dflash.torch_loader import load_into
from speculant.drafters.dflash2.checkpoint import CODEBOOKS, codebook_spelling


def load_torch_dflash2(config, info, backend, target):
    import torch

    from speculant.drafters import quantization
    from speculant.drafters.dflash2.torch import DFlash2Model, TorchDFlash2Drafter

    cfg = info.extra["config"]
    _, problems = codebook_spelling(tensor_inventory(config.path))
    if problems:
        raise CheckpointError("; ".join(str(p) for p in problems))
    model = DFlash2Model(cfg)
    load_into(model, config.path, rename={name + ".weight": name for name in CODEBOOKS})
    q = quantization.resolve(config.quantization)
    dtype = backend.dtype
    if q is not None:  # the draft computes in the spec's activation dtype
        dtype = getattr(torch, quantization.activation_dtype(q, str(backend.dtype).removeprefix("torch.")))
    model.to(device=backend._device, dtype=dtype).eval().requires_grad_(False)
    if q is not None:
        quantization.quantize_torch(model, q, quantization.exclude_for(info))
    return TorchDFlash2Drafter(model, info, target, backend)
