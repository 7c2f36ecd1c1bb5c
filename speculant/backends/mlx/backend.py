"""MLX backend: device/dtype selection, memory stats, target loading through mlx-lm."""

from __future__ import annotations

import importlib.util

from speculant.core.interfaces import Backend
from speculant.core.types import TargetInfo

_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


class MLXBackend(Backend):
    """Runs on Metal (``gpu``) on Apple Silicon and on the CPU elsewhere (``mlx[cpu]``)."""

    name = "mlx"

    def __init__(self, config) -> None:
        super().__init__(config)
        from speculant.backends.mlx import blas

        self.blas = blas.preload()
        import mlx.core as mx

        from speculant.backends.mlx.ops import MLXOps

        self._mx = mx
        self._device = resolve_device(config.device)
        mx.set_default_device(mx.gpu if self._device == "gpu" else mx.cpu)
        self.dtype = resolve_dtype(config.dtype, self._device)
        self.dtype_name = str(self.dtype).rsplit(".", 1)[-1]
        auto = "auto: Metal" if self._device == "gpu" else "auto: CPU"
        self.dtype_reason = auto if config.dtype == "auto" else "set by backend.dtype"
        self.ops = MLXOps()

    @classmethod
    def availability_problem(cls) -> str | None:
        for module in ("mlx", "mlx_lm"):
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return (f"the mlx backend needs the {module} package, which is not installed "
                        "(Apple Silicon: pip install mlx mlx-lm; Linux: pip install 'mlx[cpu]' mlx-lm)")
        from speculant.backends.mlx import blas

        try:
            blas.preload()
        except RuntimeError as exc:  # SPECULANT_MLX_BLAS names a library that cannot serve
            return str(exc)
        try:
            import mlx.core  # noqa: F401  (the CPU/Metal library itself must load)
        except Exception as exc:  # pragma: no cover - broken install
            return f"mlx is installed but cannot be imported: {type(exc).__name__}: {exc}"
        return None

    @classmethod
    def supported_dtypes(cls) -> tuple[str, ...]:
        return _DTYPE_NAMES

    @classmethod
    def family_problem(cls, target: TargetInfo) -> str | None:
        from speculant.backends.mlx.families import family_problem

        return family_problem(target)

    @classmethod
    def rollback_problem(cls, target: TargetInfo) -> str | None:
        from speculant.backends.mlx.families import rollback_problem

        return rollback_problem(target)

    @classmethod
    def tree_problem(cls, target: TargetInfo) -> str | None:
        from speculant.core.tree import layer_kinds_problem

        from speculant.backends.mlx.families import rollback_problem

        # Gated DeltaNet where the target rolls it back (its per-position taps also run trees)
        gated_deltanet = ("linear_attention",) if rollback_problem(target) is None else ()
        return layer_kinds_problem(cls.name, target.layer_types, target.model_type, also=gated_deltanet)

    @property
    def device(self) -> str:
        return self._device

    def load_target(self, path: str, info: TargetInfo):
        from speculant.backends.mlx.target import MLXTarget

        return MLXTarget.load(path, info, self)

    def int_array(self, values):
        return self._mx.array(list(values), dtype=self._mx.int32)

    writes_arrays = True

    def is_array(self, value) -> bool:
        return isinstance(value, self._mx.array)

    def save_arrays(self, path: str, arrays: dict) -> None:
        self._mx.save_safetensors(path, arrays)

    def load_arrays(self, path: str) -> dict:
        return self._mx.load(path)

    def value_name(self, value) -> str | None:
        return str(value) if isinstance(value, self._mx.Dtype) else None  # mlx.core.float32

    def named_value(self, name: str):
        value = getattr(self._mx, name.removeprefix("mlx.core."), None) if name.startswith("mlx.core.") else None
        if not isinstance(value, self._mx.Dtype):
            raise ValueError(f"{name!r}: not an mlx dtype")
        return value

    @property
    def asynchronous(self) -> bool:
        # Metal runs queued work while the host builds the next graph. On the CPU, drafting
        # ahead was measured to gain nothing (docs/history/fast-path-history.md): the forwards dwarf the host.
        return self._device == "gpu"

    def synchronize(self) -> None:
        """Wait until the work scheduled with ``mx.async_eval`` (forwards, drafts) has run."""
        self._mx.synchronize()

    def peak_memory_bytes(self) -> int | None:
        return int(self._mx.get_peak_memory())

    def reset_peak_memory(self) -> None:
        self._mx.reset_peak_memory()


def metal_available() -> bool:
    import mlx.core as mx

    try:
        return bool(mx.metal.is_available())
    except Exception:  # pragma: no cover - CPU-only builds without the metal module
        return False


def resolve_device(name: str | None) -> str:
    """``auto`` picks the Metal GPU when present, else the CPU; ``cpu`` and ``gpu`` are explicit."""
    name = (name or "auto").lower()
    if name == "auto":
        return "gpu" if metal_available() else "cpu"
    if name in ("gpu", "metal", "mps"):
        if not metal_available():
            raise RuntimeError(f"backend.device is {name!r} but Metal is not available here; use 'auto' or 'cpu'")
        return "gpu"
    if name == "cpu":
        return "cpu"
    raise RuntimeError(f"backend.device {name!r} is not an MLX device; use 'auto', 'cpu' or 'gpu'")


def resolve_dtype(name: str, device: str):
    """``auto``: bfloat16 on Metal, float32 on the CPU (exact, and faster there; docs/usage.md)."""
    import mlx.core as mx

    if name == "auto":
        return mx.bfloat16 if device == "gpu" else mx.float32
    return {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[name]
