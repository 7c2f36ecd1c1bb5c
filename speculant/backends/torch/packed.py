"""Linear weights reordered once for oneDNN, a CPU fast path of ``backend.compile`` (eager and compiled).

On a CPU, ``F.linear`` over a few rows goes to MKL's GEMM, which repacks the whole weight
matrix on every call: a verify block of 2 to 16 rows costs 2-4x a one-row step
(``benchmarks/matmul_rows.py``), so a block's cost grows with its width although its weights
are read once. oneDNN's linear over a weight reordered into its blocked layout ahead of time
costs about the same for 1 to 16 rows, though a one-row product over it is slower than
F.linear's. The target's ``nn.Linear`` layers are therefore swapped for :class:`PackedLinear`,
which holds the reordered weight, and the dense one only where it is small (under
``DENSE_ONE_ROW_BYTES``): there a one-row product (plain decoding) stays F.linear's, which was
measured faster for such weights on some CPUs; layouts.py times both at load and drops the dense
copies where the packed one-row products are as fast. Larger dense weights are released (a head tied to the
embedding leaves its table with the embedding). Results differ from F.linear's by rounding (the order of the sums), as a
wider verify block's already do: :func:`pack_linears` checks each packed layer against its dense
product and keeps the dense layers if one disagrees beyond that, or if packing fails.

Whether it pays depends on the CPU: on a 2-core AMD EPYC a packed verify block of 8 cost 1.3
one-row forwards against 1.7 dense, while on an Intel Xeon with AVX-512 it ranged from a loss to
a small gain with the model's size. So ``auto`` and ``on`` time it at load against the other
layouts (layouts.py). The drafter's layers are packed too (``TargetModel.prepare_draft``) when the
target's are. Compiled graphs run the packed product as one opaque op (:func:`packed_product`).
"""

from __future__ import annotations

import torch
from torch import nn

BATCH_HINT = 8  # rows oneDNN lays the weight out for; any row count runs on it
# Below this a layer keeps its dense weight too, for one-row products (plain decoding), at the cost of a
# second copy. A one-row F.linear beat oneDNN's packed product (2 cores, 2026-12-02: 3 MB 85 vs
# 52-138 us depending on the OpenMP wait policy, 13 MB 279-712 vs 138-317 us; 2026-12-03: 12 MB
# layers 0.90x packed). At 16 MB the 101M mid target keeps its 12 MB MLP weights dense as well, and
# its compiled plain decoding went from 0.95x to 1.11x transformers' generate (docs/history/fast-path-history.md).
DENSE_ONE_ROW_BYTES = 16 << 20
CHECK_TOLERANCE = 1e-4  # largest |packed - dense| difference, relative to the product's scale


# Inductor lowers oneDNN's linear only over weights it packed itself from frozen constants, and
# asserts otherwise; wrapped in an op of our own, the product runs in a compiled graph as one
# opaque call over the weight packed at load.
@torch.library.custom_op("speculant::packed_product", mutates_args=())
def packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` over ``W`` in oneDNN's layout (``packed``)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_product.register_fake
def _packed_product_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class PackedLinear(nn.Module):
    """``nn.Linear`` over a weight in oneDNN's layout (float32, CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        self.dense = weight if weight.numel() * weight.element_size() < DENSE_ONE_ROW_BYTES else None
        self.bias = linear.bias
        self.as_compiled = False  # run as inside a compiled graph even when eager (layouts.py times it so)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() == self.in_features:  # one row
            return nn.functional.linear(x, self.dense, self.bias)
        return self.packed_forward(x)

    def packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.as_compiled or torch.compiler.is_compiling():
            return packed_product(x.contiguous(), self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN layout"


def pack_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why linear layers on ``device`` in ``dtype`` are not packed, or None."""
    if device.type != "cpu":
        return f"packed weights are a CPU path, not {device.type}"
    if dtype != torch.float32:
        return f"packed weights are float32 only, not {str(dtype).removeprefix('torch.')}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every layer of ``model`` that is exactly ``nn.Linear``."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if type(child) is nn.Linear]


@torch.inference_mode()
def pack_linears(model: nn.Module) -> tuple[int, str | None]:
    """Swap every ``nn.Linear`` of ``model`` (exactly that class: quantized layers stay) for a
    :class:`PackedLinear`, each checked against its dense product on a few rows: (layers packed,
    None), or (0, why not) with the model left as it was."""
    found = linear_layers(model)
    if not found:
        return 0, "no nn.Linear layers to pack"
    done = []
    try:
        for parent, name, linear in found:
            packed = PackedLinear(linear)
            error = relative_error(linear, packed)
            if not error <= CHECK_TOLERANCE:  # also catches NaN
                raise ValueError(f"{name}: packed product {error:.2g} off the dense one (relative)")
            setattr(parent, name, packed)
            done.append((parent, name, linear))
    except Exception as exc:  # noqa: BLE001 -- an op oneDNN refuses here: the dense layers are exact
        _restore(done)
        return 0, f"packing the linear weights failed ({type(exc).__name__}: {str(exc)[:200]})"
    return len(found), None


def dense_copies(model: nn.Module) -> tuple[int, int]:
    """(packed layers that also keep their dense weight for one-row products, that weight's bytes)."""
    kept = [m.dense for m in model.modules() if isinstance(m, PackedLinear) and m.dense is not None]
    return len(kept), sum(w.numel() * w.element_size() for w in kept)


def drop_dense_copies(model: nn.Module) -> None:
    """Run one-row products over the packed weights too, releasing the dense copies."""
    for m in model.modules():
        if isinstance(m, PackedLinear):
            m.dense = None


def _restore(done: list) -> None:
    for parent, name, linear in done:
        setattr(parent, name, linear)


def relative_error(linear: nn.Linear, other: nn.Module) -> float:
    """Largest difference of ``other``'s product from ``linear``'s on 3 random rows, relative to its scale."""
    weight = linear.weight
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    dense = nn.functional.linear(x, weight, linear.bias)
    scale = float(dense.abs().max()) or 1.0
    return float((other(x) - dense).abs().max()) / scale
