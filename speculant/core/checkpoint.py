"""Read checkpoint metadata without loading weights: safetensors headers and index files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from speculant.core.errors import CheckpointError


def safetensors_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def read_safetensors_header(file: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` from a .safetensors file's JSON header only."""
    file = Path(file)
    try:
        with file.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(fh.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None
    header.pop("__metadata__", None)
    return {name: (meta["dtype"], tuple(meta["shape"])) for name, meta in header.items()}


def tensor_inventory(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """All tensors of a folder's safetensors shards (names must be unique across shards)."""
    inventory: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in safetensors_files(folder):
        for name, meta in read_safetensors_header(file).items():
            if name in inventory:
                raise CheckpointError(f"tensor {name!r} appears in more than one shard of {folder}")
            inventory[name] = meta
    return inventory


def compare_inventory(
    found: dict[str, tuple[str, tuple[int, ...]]],
    expected: dict[str, tuple[int, ...]],
    optional: set[str] = frozenset(),
) -> list[str]:
    """Human-readable differences: missing, unexpected and mis-shaped tensors."""
    problems = []
    for name, shape in expected.items():
        if name not in found:
            if name not in optional:
                problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif tuple(found[name][1]) != tuple(shape):
            problems.append(f"tensor {name} has shape {list(found[name][1])}, expected {list(shape)}")
    for name in found:
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
    return problems
