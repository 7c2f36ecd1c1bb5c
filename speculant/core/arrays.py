"""The few array operations the backend-neutral math needs.

Verifiers and shared drafter math are written once against :class:`ArrayOps`; each backend
supplies an implementation over its own arrays (``torch.Tensor``, ``mlx.core.array``).
Arithmetic and comparison operators, slicing and ``.shape`` are used directly on the arrays,
since every supported array type provides them with NumPy semantics.
:class:`NumpyOps` is the reference implementation, used by unit tests.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import numpy as np

Array = Any


class ArrayOps(Protocol):
    """Backend-provided primitives; every reduction works on the last axis."""

    name: str

    def asarray(self, values: Sequence[float] | Sequence[int] | np.ndarray, dtype: str = "float32") -> Array:
        """Copy host values to the backend (dtype: float32 | int64 | int32)."""

    def to_numpy(self, x: Array) -> np.ndarray:
        """Copy to host memory (this synchronises the device)."""

    def to_list(self, x: Array) -> list:
        """Copy to a nested Python list."""

    def float32(self, x: Array) -> Array: ...
    def softmax(self, x: Array) -> Array: ...
    def log_softmax(self, x: Array) -> Array: ...
    def argmax(self, x: Array) -> Array: ...
    def sort_descending(self, x: Array) -> Array: ...
    def cumsum(self, x: Array) -> Array: ...
    def sum(self, x: Array, keepdims: bool = False) -> Array: ...
    def max(self, x: Array, keepdims: bool = False) -> Array: ...
    def gather(self, x: Array, indices: Array) -> Array:
        """``out[..., j] = x[..., indices[..., j]]``."""

    def scatter_add(self, x: Array, indices: Array, values: Array) -> Array:
        """Return a copy of ``x`` with ``values`` added at ``indices`` along the last axis."""

    def where(self, condition: Array, a: Array, b: Array) -> Array: ...
    def maximum(self, a: Array, b: Array | float) -> Array: ...
    def concatenate(self, arrays: Sequence[Array], axis: int = 0) -> Array: ...
    def all_finite(self, x: Array) -> bool: ...
    def full(self, shape: tuple[int, ...], value: float, dtype: str = "float32") -> Array: ...


class NumpyOps:
    """Reference :class:`ArrayOps` over NumPy arrays."""

    name = "numpy"

    _dtypes = {"float32": np.float32, "int64": np.int64, "int32": np.int32, "bool": np.bool_}

    def asarray(self, values, dtype="float32"):
        return np.asarray(values, dtype=self._dtypes[dtype])

    def to_numpy(self, x):
        return np.asarray(x)

    def to_list(self, x):
        return np.asarray(x).tolist()

    def float32(self, x):
        return np.asarray(x, dtype=np.float32)

    def softmax(self, x):
        z = x - np.max(x, axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)

    def log_softmax(self, x):
        z = x - np.max(x, axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    def argmax(self, x):
        return np.argmax(x, axis=-1)

    def sort_descending(self, x):
        return -np.sort(-x, axis=-1)

    def cumsum(self, x):
        return np.cumsum(x, axis=-1, dtype=x.dtype)

    def sum(self, x, keepdims=False):
        return np.sum(x, axis=-1, keepdims=keepdims, dtype=x.dtype)

    def max(self, x, keepdims=False):
        return np.max(x, axis=-1, keepdims=keepdims)

    def gather(self, x, indices):
        return np.take_along_axis(x, np.asarray(indices, dtype=np.int64), axis=-1)

    def scatter_add(self, x, indices, values):
        out = np.array(x, copy=True)
        idx = np.asarray(indices, dtype=np.int64)
        if out.ndim == 1:
            np.add.at(out, idx, values)
        else:
            rows = np.arange(out.shape[0])[:, None]
            np.add.at(out, (rows, idx), values)
        return out

    def where(self, condition, a, b):
        return np.where(condition, a, b)

    def maximum(self, a, b):
        return np.maximum(a, b)

    def concatenate(self, arrays, axis=0):
        return np.concatenate(arrays, axis=axis)

    def all_finite(self, x):
        return bool(np.isfinite(x).all())

    def full(self, shape, value, dtype="float32"):
        return np.full(shape, value, dtype=self._dtypes[dtype])


def fetch(ops: ArrayOps, parts: Sequence[Array]) -> list[float]:
    """Move several small 1-D arrays to the host in one transfer, as float32 values."""
    return ops.to_list(ops.concatenate([ops.float32(p) for p in parts]))


def fetch_rows(ops: ArrayOps, rows: Sequence[Sequence[Array]]) -> list[list[float]]:
    """Several rows' 1-D arrays in one :func:`fetch`: row ``i``'s values are ``rows[i]``'s
    concatenated (a batch reads every request's verification at once, not one device
    synchronisation per request)."""
    parts = [part for row in rows for part in row]
    values = fetch(ops, parts) if parts else []
    out, at = [], 0
    for row in rows:
        size = sum(int(part.shape[0]) for part in row)
        out.append(values[at:at + size])
        at += size
    return out
