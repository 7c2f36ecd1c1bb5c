"""ArrayOps over torch tensors."""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


class TorchOps:
    name = "torch"

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)

    def asarray(self, values, dtype="float32"):
        return torch.as_tensor(np.asarray(values), dtype=_DTYPES[dtype], device=self.device)

    def to_numpy(self, x):
        return x.detach().cpu().numpy()

    def to_list(self, x):
        return x.detach().cpu().tolist()

    def float32(self, x):
        return x.float()

    def softmax(self, x):
        return torch.softmax(x, dim=-1)

    def log_softmax(self, x):
        return torch.log_softmax(x, dim=-1)

    def argmax(self, x):
        return torch.argmax(x, dim=-1)

    def sort_descending(self, x):
        return torch.sort(x, dim=-1, descending=True).values

    def cumsum(self, x):
        return torch.cumsum(x, dim=-1)

    def sum(self, x, keepdims=False):
        return torch.sum(x, dim=-1, keepdim=keepdims)

    def max(self, x, keepdims=False):
        return torch.amax(x, dim=-1, keepdim=keepdims)

    def gather(self, x, indices):
        return torch.gather(x, -1, indices.long())

    def scatter_add(self, x, indices, values):
        return x.scatter_add(-1, indices.long(), values)

    def where(self, condition, a, b):
        if not torch.is_tensor(a):
            a = torch.as_tensor(a, dtype=b.dtype if torch.is_tensor(b) else torch.float32, device=self.device)
        if not torch.is_tensor(b):
            b = torch.as_tensor(b, dtype=a.dtype, device=self.device)
        return torch.where(condition, a, b)

    def maximum(self, a, b):
        if not torch.is_tensor(b):
            return torch.clamp(a, min=b)
        return torch.maximum(a, b)

    def concatenate(self, arrays, axis=0):
        return torch.cat(list(arrays), dim=axis)

    def all_finite(self, x):
        return bool(torch.isfinite(x).all())

    def full(self, shape, value, dtype="float32"):
        return torch.full(shape, value, dtype=_DTYPES[dtype], device=self.device)
