"""ArrayOps over ``mlx.core`` arrays (same semantics as NumpyOps and TorchOps).

Everything stays lazy except :meth:`MLXOps.to_numpy`, :meth:`MLXOps.to_list` and
:meth:`MLXOps.all_finite`, which evaluate the graph and copy to the host.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

_DTYPES = {"float32": mx.float32, "int64": mx.int64, "int32": mx.int32, "bool": mx.bool_}


class MLXOps:
    name = "mlx"

    def asarray(self, values, dtype="float32"):
        return mx.array(np.asarray(values), dtype=_DTYPES[dtype])

    def to_numpy(self, x):
        return np.array(x)

    def to_list(self, x):
        return x.tolist()

    def float32(self, x):
        return x.astype(mx.float32)

    def softmax(self, x):
        return mx.softmax(x, axis=-1, precise=True)

    def log_softmax(self, x):
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def argmax(self, x):
        return mx.argmax(x, axis=-1).astype(mx.int32)

    def sort_descending(self, x):
        return -mx.sort(-x, axis=-1)

    def cumsum(self, x):
        return mx.cumsum(x, axis=-1)

    def sum(self, x, keepdims=False):
        return mx.sum(x, axis=-1, keepdims=keepdims)

    def max(self, x, keepdims=False):
        return mx.max(x, axis=-1, keepdims=keepdims)

    def gather(self, x, indices):
        return mx.take_along_axis(x, indices.astype(mx.int32), axis=-1)

    def scatter_add(self, x, indices, values):
        idx = indices.astype(mx.int32)
        if x.ndim == 1:
            return x.at[idx].add(values)
        rows = mx.arange(x.shape[0])[:, None]
        return x.at[rows, idx].add(values)

    def where(self, condition, a, b):
        return mx.where(condition, a, b)

    def maximum(self, a, b):
        return mx.maximum(a, b)

    def concatenate(self, arrays, axis=0):
        arrays = list(arrays)
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) > 1 and all(mx.issubdtype(d, mx.integer) for d in dtypes):
            arrays = [a.astype(mx.int32) for a in arrays]  # token ids of mixed int widths
        return mx.concatenate(arrays, axis=axis)

    def all_finite(self, x):
        return bool(mx.all(mx.isfinite(x)).item())

    def full(self, shape, value, dtype="float32"):
        return mx.full(shape, value, dtype=_DTYPES[dtype])
