"""A fast CBLAS under MLX's CPU backend on Linux.

MLX's Linux wheel (``mlx[cpu]``) links the reference netlib BLAS, whose ``cblas_sgemm`` is a plain
triple loop: a ``[16, 576] @ [576, 1536]`` product took 8.0 ms there against 1.1 ms through MKL
(2-core AMD EPYC, 2026-12-06, docs/batching.md). Batched verification multiplies many rows at
once, so on that BLAS a batch costs about what its rows cost one by one.

``libmlx.so`` binds ``cblas_sgemm`` when it loads, looking first in the libraries already loaded
globally, so a CBLAS loaded that way before ``mlx.core`` is imported takes the reference one's
place. PyTorch is imported first where it is installed, so that its own statically linked BLAS
keeps binding to itself rather than to this library (its products slowed 1.8x otherwise).

MLX runs one product at a time per stream, so MKL spreads each product over the usable cores
through OpenMP's libgomp (the one torch loads, where it is loaded; ``MKL_NUM_THREADS`` caps it):
on 2 cores a 512-token prefill chunk of SmolLM2 took 2.1 s against 2.6 s one thread a call, and
16 batched requests decoded 1.23x faster plain, 1.13x speculative (2026-12-06,
docs/mlx-on-linux.md). Intel's own OpenMP runtime was slower there than one thread. Without
libgomp, or on one core, MKL runs sequentially.

``SPECULANT_MLX_BLAS`` chooses: ``auto`` (default: the ``mkl`` package where it is installed),
``off`` (MLX's own BLAS), or the path of a shared library exporting ``cblas_sgemm``.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys

from speculant.core.timing import usable_cores

ENV = "SPECULANT_MLX_BLAS"
MKL_SEQUENTIAL = 1  # MKL_Set_Threading_Layer's values: one thread per call,
MKL_GNU = 3  # or OpenMP through libgomp

_state: dict[str, str] = {}


def preload() -> str:
    """Load the CBLAS ``SPECULANT_MLX_BLAS`` names before ``mlx.core`` is imported; once per
    process. Returns what MLX's CPU products run on, for the target's ``fast_path``."""
    if "note" not in _state:
        _state["note"] = _preload()
    return _state["note"]


def _preload() -> str:
    setting = os.environ.get(ENV, "auto").strip() or "auto"
    if setting == "off" or sys.platform != "linux":
        return "MLX's own BLAS"
    if "mlx.core" in sys.modules:
        return "MLX's own BLAS (mlx was imported before speculant could load a faster one)"
    path = _mkl_path() if setting == "auto" else setting
    if path is None:
        return "MLX's own BLAS (the reference BLAS on Linux; pip install mkl for a faster one)"
    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401  (binds its own BLAS before ours is global; see the docstring)
    try:
        library = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        library.cblas_sgemm  # noqa: B018  (a library without it would change nothing)
    except (OSError, AttributeError) as exc:
        raise RuntimeError(f"{ENV}={setting!r}: cannot use {path} as MLX's BLAS ({exc}); "
                           f"set {ENV}=off to keep MLX's own") from exc
    _state["library"] = os.path.basename(path)
    if hasattr(library, "MKL_Set_Threading_Layer"):
        threads = _mkl_threads(library)
        _state["library"] += f", {threads} thread{'s' if threads > 1 else ''}"
    return f"BLAS: {_state['library']}"


def _mkl_threads(library) -> int:
    """Set MKL's threads per call: the usable cores through libgomp where it loads, else one."""
    cores = usable_cores()
    threads = min(cores, int(os.environ.get("MKL_NUM_THREADS", cores) or cores))
    if threads > 1:
        try:
            ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)  # MKL's GNU layer needs it at its first call
        except OSError:
            threads = 1
    if threads == 1:
        library.MKL_Set_Threading_Layer(MKL_SEQUENTIAL)
        return 1
    library.MKL_Set_Threading_Layer(MKL_GNU)
    library.MKL_Set_Num_Threads(threads)
    return threads


def in_use() -> str:
    """The CBLAS MLX's products bind to: a loaded library's file name (MKL's with its threads per
    call), or ``mlx`` (its own)."""
    return _state.get("library", "mlx")


def _mkl_path() -> str | None:
    try:
        files = importlib.metadata.distribution("mkl").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name.startswith("libmkl_rt.so")]
    return str(found[0].locate().resolve()) if found else None
