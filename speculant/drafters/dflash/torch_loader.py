"""Load published DFlash safetensors into the torch draft model (never pickle)."""

from __future__ import annotations

from pathlib import Path

from speculant.core.checkpoint import require_float_tensors, safetensors_files
from speculant.core.errors import CheckpointError


def read_state_dict(folder: str | Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for file in safetensors_files(folder):
        state.update(load_file(str(file)))
    return state


def load_into(model, folder: str | Path, rename: dict[str, str] | None = None) -> None:
    """Strict load: every model tensor present, a float, with the right shape, nothing extra."""
    require_float_tensors(folder)
    state = read_state_dict(folder)
    for old, new in (rename or {}).items():
        if old in state:
            state[new] = state.pop(old)
    own = model.state_dict()
    problems = [f"missing tensor {k}" for k in own if k not in state]
    problems += [f"unexpected tensor {k}" for k in state if k not in own]
    problems += [f"tensor {k} has shape {list(state[k].shape)}, expected {list(own[k].shape)}"
                 for k in own if k in state and state[k].shape != own[k].shape]
    if problems:
        raise CheckpointError(f"{folder}: " + "; ".join(problems))
    model.load_state_dict(state, strict=True)


def place_and_quantize(model, config, info, backend):
    """Move a loaded draft to the backend's device, in the quantization spec's activation dtype
    when one is set, then quantize its weights in memory (frozen, eval mode)."""
    import torch

    from speculant.drafters import quantization

    q = quantization.resolve(config.quantization)
    dtype = backend.dtype
    if q is not None:
        dtype = getattr(torch, quantization.activation_dtype(q, str(backend.dtype).removeprefix("torch.")))
    model.to(device=backend._device, dtype=dtype).eval().requires_grad_(False)
    if q is not None:
        quantization.quantize_torch(model, q, quantization.exclude_for(info, q))
    return model


def follow_target(network, config, info, backend, target) -> None:
    """Lay the draft's weights out as the target's are (the CPU's transposed or packed weights),
    then run the draft step compiled (dflash/compiled.py) where the target is (with an eager target
    the draft's share of a cycle is not where the time goes, and compiling costs seconds)."""
    if getattr(backend.config, "compile", "off") == "off":
        return
    laid_out = target.prepare_draft(network.model)
    if not str(getattr(target, "fast_path", "")).startswith("compiled"):
        network.fast_path = laid_out or network.fast_path
        return
    network.layout_note = laid_out.removeprefix("eager").lstrip(":; ") if laid_out else None
    network.compile_step(config.block_size or info.default_block_size or info.trained_block_size or 2)


def load_torch_drafter(config, info, backend, target):
    from speculant.drafters.dflash import muse_glimmer
    from speculant.drafters.dflash.drafter import DFlashDrafter
    from speculant.drafters.dflash.torch import DFlashModel, TorchDFlashNetwork

    cfg = info.extra["config"]
    model = DFlashModel(cfg)
    load_into(model, config.path, rename=muse_glimmer.TENSOR_NAMES if cfg.is_muse_glimmer else None)
    network = TorchDFlashNetwork(place_and_quantize(model, config, info, backend), target, backend)
    follow_target(network, config, info, backend, target)
    return DFlashDrafter(network, info, backend)
