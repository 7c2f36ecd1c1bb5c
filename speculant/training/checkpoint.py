"""Resumable training state without pickle: model and optimizer tensors in safetensors,
step counters and settings in JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model


def save_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> None:
    """Write atomically: a partial checkpoint never replaces a complete one."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))  # handles tied (shared) tensors
    tensors, scalars = {}, {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                name = f"{names[id(p)]}::{key}"
                if torch.is_tensor(value) and value.dim() > 0:
                    tensors[name] = value.detach().contiguous().cpu()
                else:
                    scalars[name] = float(value)
    save_file(tensors or {"__empty__": torch.zeros(1)}, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({**meta, "optimizer_scalars": scalars}, indent=1))
    if folder.exists():
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    os.replace(tmp, folder)


def load_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    folder = Path(folder)
    missing, unexpected = load_model(model, str(folder / "model.safetensors"), strict=True)
    meta = json.loads((folder / "state.json").read_text())
    tensors = load_file(str(folder / "optimizer.safetensors"))
    params = dict(model.named_parameters())
    for name, value in list(tensors.items()) + list(meta.pop("optimizer_scalars", {}).items()):
        if name == "__empty__":
            continue
        pname, key = name.split("::")
        param = params[pname]
        if not torch.is_tensor(value):
            value = torch.tensor(value)
        optimizer.state[param][key] = value.to(param.device)
    return meta
