"""PyTorch backend: device/dtype selection, memory stats, target loading."""

from __future__ import annotations

import importlib.util

from speculant.core.interfaces import Backend
from speculant.core.types import TargetInfo

_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# Layer kinds the torch target rolls back exactly after a rejected block (rollback.py); Gated
# DeltaNet linear attention only in the families whose delta rule the target records.
_ROLLED_BACK = ("full_attention", "sliding_attention")
GATED_DELTANET_FAMILIES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, config) -> None:
        super().__init__(config)
        import torch

        from speculant.backends.torch.ops import TorchOps

        self._device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self._device)
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.dtype_reason = dtype_reason(config.dtype, self._device)
        self.ops = TorchOps(self._device)
        self._torch = torch

    @classmethod
    def availability_problem(cls) -> str | None:
        for module in ("torch", "transformers"):
            if importlib.util.find_spec(module) is None:
                return f"the torch backend needs the {module} package, which is not installed"
        return None

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        return _DTYPE_NAMES

    @classmethod
    def family_problem(cls, target: TargetInfo) -> str | None:
        from speculant.backends.torch.loading import family_problem

        return family_problem(target.path)

    @classmethod
    def rollback_problem(cls, target: TargetInfo) -> str | None:
        gated_deltanet = target.model_type in GATED_DELTANET_FAMILIES
        kinds = dict.fromkeys(target.layer_types or ("full_attention",))
        refused = [k for k in kinds if k not in _ROLLED_BACK and not (k == "linear_attention" and gated_deltanet)]
        if not refused:
            return None
        return (
            f"the torch backend cannot roll back {', '.join(refused)} layers (target family {target.model_type}) "
            "after a rejected block; it rolls back full_attention, sliding_attention and the Gated DeltaNet "
            f"linear_attention of {', '.join(GATED_DELTANET_FAMILIES)}"
        )

    @classmethod
    def tree_problem(cls, target: TargetInfo) -> str | None:
        from speculant.core.tree import layer_kinds_problem

        gated_deltanet = ("linear_attention",) if target.model_type in GATED_DELTANET_FAMILIES else ()
        return layer_kinds_problem(cls.name, target.layer_types, target.model_type, also=gated_deltanet)

    @property
    def device(self) -> str:
        return str(self._device)

    def load_target(self, path: str, info: TargetInfo):
        from speculant.backends.torch.target import TorchTarget

        return TorchTarget.load(path, info, self)

    def int_array(self, values):
        return self._torch.tensor(list(values), dtype=self._torch.long, device=self._device)

    writes_arrays = True

    def is_array(self, value) -> bool:
        return isinstance(value, self._torch.Tensor)

    def save_arrays(self, path: str, arrays: dict) -> None:
        from safetensors.torch import save_file

        save_file({name: a.detach().clone().contiguous() for name, a in arrays.items()}, path)  # no shared storage

    def load_arrays(self, path: str) -> dict:
        from safetensors.torch import load_file

        return load_file(path, device=str(self._device))

    def value_name(self, value) -> str | None:
        torch = self._torch
        if isinstance(value, torch.dtype):
            return str(value)  # torch.float32
        return f"device:{value}" if isinstance(value, torch.device) else None

    def named_value(self, name: str):
        torch = self._torch
        if name.startswith("device:"):
            return torch.device(name.removeprefix("device:"))
        value = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
        if not isinstance(value, torch.dtype):
            raise ValueError(f"{name!r}: not a torch dtype or device")
        return value

    @property
    def asynchronous(self) -> bool:
        return self._device.type in ("cuda", "mps")  # CPU ops run before they return

    def synchronize(self) -> None:
        if self._device.type == "cuda":
            self._torch.cuda.synchronize(self._device)
        elif self._device.type == "mps":
            self._torch.mps.synchronize()

    def peak_memory_bytes(self) -> int | None:
        if self._device.type == "cuda":
            return int(self._torch.cuda.max_memory_allocated(self._device))
        if self._device.type == "mps":
            return int(self._torch.mps.driver_allocated_memory())
        return _process_peak_rss()

    def reset_peak_memory(self) -> None:
        if self._device.type == "cuda":
            self._torch.cuda.reset_peak_memory_stats(self._device)


def resolve_device(name: str):
    """``auto`` picks CUDA, then MPS, then CPU; anything else is passed to torch.device."""
    import torch

    if name in ("auto", "", None):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"backend.device is {name!r} but CUDA is not available here; use 'auto' or 'cpu'")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(f"backend.device is {name!r} but MPS is not available here; use 'auto' or 'cpu'")
    return device


def resolve_dtype(name: str, device):
    """``auto``: bfloat16 on CUDA (if supported), float16 on MPS, float32 on CPU (exact: speculative
    output equals plain decoding, and on the CPUs measured faster than bfloat16; docs/usage.md)."""
    import torch

    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def dtype_reason(name: str, device) -> str:
    """Why ``resolve_dtype`` chose what it did, for the statistics."""
    import torch

    if name != "auto":
        return "set by backend.dtype"
    if device.type == "cuda":
        return "auto: CUDA" if torch.cuda.is_bf16_supported() else "auto: CUDA without bfloat16"
    return "auto: MPS" if device.type == "mps" else "auto: CPU"


def _process_peak_rss() -> int | None:
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except Exception:  # pragma: no cover - non-POSIX
        return None
