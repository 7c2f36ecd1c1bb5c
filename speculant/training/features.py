"""Target features for training, taken through the inference capture path (TorchTarget hooks)."""

from __future__ import annotations

from pathlib import Path

import torch

from speculant.core.config import BackendConfig
from speculant.core.types import Capture
from speculant.core.validator import read_target_info


def training_device() -> str:
    """Where drafters train: the GPU when there is one (the target and the draft both), else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_frozen_target(path: str | Path, device: str | None = None, dtype: str | None = None):
    """The target as inference loads it (TorchBackend + TorchTarget), frozen; its layers stay
    plain ``nn.Linear`` (compile off), since the draft's loss back-propagates through its head.
    Default: on :func:`training_device`, in bfloat16 on a GPU (the draft trains under bf16
    autocast there anyway) and float32 on a CPU."""
    from speculant.backends.torch.backend import TorchBackend

    device = device or training_device()
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")

    backend = TorchBackend(BackendConfig(kind="torch", device=device, dtype=dtype, compile="off"))
    return backend.load_target(str(path), read_target_info(Path(path)))


@torch.no_grad()
def capture_batch(target, input_ids: torch.Tensor, capture: Capture) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Features [B, S, K*H] (and final hidden [B, S, H]) for whole sequences, no KV cache,
    through the same forward hooks inference uses."""
    recorder = target._recorder
    recorder.start(capture)
    try:
        target.model.model(input_ids=input_ids.to(target.model.device), use_cache=False)
    finally:
        got, recorder.active = recorder.active or {}, None
    features = torch.cat([got[i] for i in capture.layer_ids], dim=-1) if capture.layer_ids else None
    final = None
    if capture.final_hidden is not None:
        final = got["post_norm" if capture.final_hidden == "post_norm" else recorder.last_layer]
    return features, final
