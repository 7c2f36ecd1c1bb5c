"""Linear weights stored transposed, a CPU fast path of ``backend.compile`` on PyTorch.

``F.linear`` computes ``x @ W.T`` over a weight stored [out, in]. For 2 to 16 rows MKL's GEMM
copies such a weight into its packed layout on every call; over the same weight stored [in, out]
(``x @ W_t``) it does not. On an Intel Xeon with AVX-512 and one thread, a product of 8 rows
ran 1.3-2.5x faster transposed, and one row as fast or faster, for every layer shape of the
shipped and mid targets (docs/history/fast-path-history.md). Unlike oneDNN's packed layout (packed.py) the
transposed weight is a plain tensor, so ``torch.compile``d graphs run over it too.

The target's float32 ``nn.Linear`` layers (exactly that class: quantized ones stay) become
:class:`TransposedLinear`, each checked against the dense product on a few rows; a failure puts
the layers back as they were (transposing back is exact). A head tied to the embedding gets a
transposed copy of the table only below ``TIED_COPY_BYTES``. Whether it pays depends on the CPU
and the model, so ``auto`` times it at load against the other layouts (layouts.py).
"""

from __future__ import annotations

import torch
from torch import nn

from speculant.backends.torch.packed import CHECK_TOLERANCE, linear_layers, relative_error

TIED_COPY_BYTES = 1 << 30  # a tied head's transposed copy of the embedding is made only below this


class TransposedLinear(nn.Module):
    """``nn.Linear`` over its weight stored [in, out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] view that model code inspecting ``layer.weight`` expects."""
        return self.weight_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.matmul(x, self.weight_t)
        return out if self.bias is None else out + self.bias

    def to_linear(self) -> nn.Linear:
        """The ``nn.Linear`` this was made from (transposing back is exact)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.weight_t.device, dtype=self.weight_t.dtype)
        linear.weight = nn.Parameter(self.weight_t.detach().t().contiguous(), requires_grad=False)
        linear.bias = self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, stored [in, out]"


@torch.inference_mode()
def transpose_linears(model: nn.Module) -> tuple[int, str | None]:
    """Swap every float32 ``nn.Linear`` of ``model`` for a checked :class:`TransposedLinear`:
    (layers swapped, None), or (0, why not) with the model left as it was."""
    # a plain float32 weight only: torchao's quantized drafts keep nn.Linear over a tensor subclass
    found = [(parent, name, linear) for parent, name, linear in linear_layers(model)
             if linear.weight.dtype == torch.float32 and type(linear.weight) in (nn.Parameter, torch.Tensor)]
    shared = _shared_weights(model)
    found = [entry for entry in found if not _too_large_to_copy(entry[2], shared)]
    if not found:
        return 0, "no float32 nn.Linear layers to transpose"
    count, done = len(found), []
    found.reverse()
    while found:  # popped, so that the list holds no original once it is swapped out
        parent, name, linear = found.pop()
        swapped = TransposedLinear(linear)
        error = relative_error(linear, swapped)
        if not error <= CHECK_TOLERANCE:  # also catches NaN
            _restore(done)
            return 0, f"{name}: the transposed product is {error:.2g} off the dense one (relative)"
        setattr(parent, name, swapped)
        # a tied weight stays with its other owner anyway; any other original goes once swapped
        done.append((parent, name, swapped, linear if id(linear.weight) in shared else None))
    return count, None


def _shared_weights(model: nn.Module) -> set[int]:
    """Ids of the weights some other module also holds (a head tied to the embedding)."""
    return {id(p) for m in model.modules() if type(m) is not nn.Linear for p in m.parameters(recurse=False)}


def _too_large_to_copy(linear: nn.Linear, shared: set[int]) -> bool:
    weight = linear.weight
    return id(weight) in shared and weight.numel() * weight.element_size() >= TIED_COPY_BYTES


def _restore(done: list) -> None:
    for parent, name, swapped, original in done:
        setattr(parent, name, original if original is not None else swapped.to_linear())
