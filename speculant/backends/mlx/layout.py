"""Linear weights stored transposed, the CPU fast path of ``backend.compile`` on MLX.

``nn.Linear`` computes ``x @ W.T`` over a weight stored [out, in]. On MLX's CPU the product goes
to the BLAS the wheel was built with (the Linux wheel bundles the reference BLAS), whose cost grows
with the rows, and which is 25-30 % faster over a weight stored [in, out] (``x @ W_t``) for 1 to 16
rows in float32, with the same results (``benchmarks/matmul_rows.py``, docs/history/fast-path-history.md). In
bfloat16 or float16 it gained nothing, so only float32 layers are transposed, and since another
BLAS (Accelerate on a Mac's CPU) may rank the layouts otherwise, the target's ``auto`` times both
over its own layers at load (:func:`measured_speedup`) and keeps the faster. The target's
``nn.Linear`` layers (exactly that class: quantized ones stay) become :class:`TransposedLinear`,
each checked against the dense product on a few rows; the drafter's are transposed too
(``TargetModel.prepare_draft``). A head tied to the embedding reads a transposed copy of the
table (:class:`TransposedTiedEmbedding`) where the copy is not too large. Mixture-of-experts
layers (mlx-lm's ``SwitchLinear``, a ``gather_mm`` over [experts, out, in]) follow the dense
layers' decision as :class:`TransposedSwitchLinear`: over [experts, in, out] the product gave the
same results 1.2-1.3x faster for 1 to 40 rows on this CPU (``benchmarks/expert_layout.py``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.switch_layers import SwitchLinear

from speculant.backends.mlx import blas
from speculant.backends.mlx.wrapper import Wrapper
from speculant.core import timing

MEASURED_ROWS = (1, 8)  # a plain step and a verify block: what auto times both layouts on
CHECK_TOLERANCE = 1e-4  # largest |transposed - dense| difference, relative to the product's scale
TIED_COPY_BYTES = 1 << 30  # a tied head's transposed copy of the embedding is made only below this


class TransposedLinear(nn.Module):
    """``nn.Linear`` over its weight stored [in, out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    @property
    def weight(self) -> mx.array:
        """The [out, in] view that model code inspecting ``layer.weight`` expects."""
        return self.weight_t.T

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t

    def to_linear(self) -> nn.Linear:
        """The ``nn.Linear`` this was made from (transposing back is exact)."""
        out_dims, in_dims = self.weight.shape
        linear = nn.Linear(in_dims, out_dims, bias="bias" in self)
        linear.weight = mx.contiguous(self.weight_t.T)
        if "bias" in self:
            linear.bias = self.bias
        return linear


class TransposedSwitchLinear(nn.Module):
    """mlx-lm's ``SwitchLinear`` (a linear layer per expert) over its weights stored [experts, in, out]."""

    def __init__(self, switch: SwitchLinear) -> None:
        super().__init__()
        self.weight_t = mx.contiguous(switch.weight.swapaxes(-1, -2))
        if "bias" in switch:
            self.bias = switch.bias

    @property
    def weight(self) -> mx.array:
        return self.weight_t.swapaxes(-1, -2)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_mm(x, self.weight_t, rhs_indices=indices, sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self.bias[indices], -2)
        return x

    def to_linear(self) -> SwitchLinear:
        """The ``SwitchLinear`` this was made from."""
        experts, input_dims, output_dims = self.weight_t.shape
        switch = SwitchLinear(input_dims, output_dims, experts, bias="bias" in self)
        switch.weight = mx.contiguous(self.weight)
        if "bias" in self:
            switch.bias = self.bias
        return switch


TRANSPOSED = {nn.Linear: TransposedLinear, SwitchLinear: TransposedSwitchLinear}


class TransposedTiedEmbedding(Wrapper):
    """An embedding whose ``as_linear`` (the tied output head) reads a transposed copy of the table."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__(embedding)
        self.weight_t = mx.contiguous(embedding.weight.T)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.module(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


def transpose_linears(model: nn.Module, measure: bool = False) -> tuple[int, str | None]:
    """Swap every float32 ``nn.Linear`` (and ``SwitchLinear``) of ``model`` for a checked
    :class:`TransposedLinear` (:class:`TransposedSwitchLinear`), and, with ``measure``, only if
    transposed dense products are first measured faster here (core/timing.py): (layers swapped,
    None), or (0, why not) with the model left as it was."""
    found = {path: layer for path, layer in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)
             if type(layer) in TRANSPOSED and layer.weight.dtype == mx.float32}
    dense = [layer for layer in found.values() if type(layer) is nn.Linear]
    if not dense:
        return 0, "no float32 nn.Linear layers to transpose"
    gain = None
    if measure:
        gain = timing.remembered("mlx transposed", library_key(dense), lambda: measured_speedup(dense))
    if gain is not None and not gain >= timing.MARGIN:
        return 0, f"transposed products were measured no faster than the layout as loaded on this CPU ({gain:.2f}x)"
    count, done = len(found), []
    for path in list(found):
        linear = found.pop(path)  # the original goes once it is swapped out: a failure transposes back
        swapped = TRANSPOSED[type(linear)](linear)
        error = _relative_error(linear, swapped)
        if not error <= CHECK_TOLERANCE:  # also catches NaN
            model.update_modules(tree_unflatten([(p, layer.to_linear()) for p, layer in done]))
            return 0, f"{path}: the transposed product is {error:.2g} off the dense one (relative)"
        model.update_modules(tree_unflatten([(path, swapped)]))
        done.append((path, swapped))
    return count, None


def library_key(layers: list[nn.Module]) -> dict:
    """What a layout's timing depends on here besides the CPU (core/timing.py remembers it)."""
    return {"mlx": mx.__version__, "device": str(mx.default_device()), "blas": blas.in_use(),
            "shapes": [[*layer.weight.shape, str(layer.weight.dtype)] for layer in layers]}


def measured_speedup(linears: list[nn.Linear]) -> float:
    """Time as loaded over time transposed, over ``linears`` in order up to the working set
    (core/timing.py), each run on a plain step's row and a verify block's."""
    sample = timing.working_set(linears, lambda d: d.weight.nbytes)
    swapped = [TransposedLinear(d) for d in sample]
    xs = {(rows, d.weight.shape[1]): mx.random.normal((rows, d.weight.shape[1]), key=mx.random.key(rows))
          for d in sample for rows in MEASURED_ROWS}
    mx.eval(list(xs.values()), [layer.weight_t for layer in swapped])

    def run(layers):
        return lambda: mx.eval([layer(xs[rows, layer.weight.shape[1]]) for rows in MEASURED_ROWS for layer in layers])

    return timing.speedup(run(sample), run(swapped))


def transpose_tied_head(inner: nn.Module) -> bool:
    """Give a tied head (``embed_tokens.as_linear``) a transposed copy of the table, if it is
    float32 and the copy is under ``TIED_COPY_BYTES``; whether it did."""
    embedding = inner.embed_tokens
    if type(embedding) is not nn.Embedding or embedding.weight.dtype != mx.float32:
        return False
    if embedding.weight.nbytes >= TIED_COPY_BYTES:
        return False
    inner.embed_tokens = TransposedTiedEmbedding(embedding)
    mx.eval(inner.embed_tokens.weight_t)
    return True


def relative_error(want: mx.array, have: mx.array) -> float:
    """Largest |have - want|, relative to want's largest magnitude (NaN where either has one)."""
    scale = mx.abs(want).max().item() or 1.0
    return mx.abs(have - want).max().item() / scale


def _relative_error(linear: nn.Module, swapped: nn.Module) -> float:
    x = mx.random.normal((3, linear.weight.shape[-1]), key=mx.random.key(0)).astype(linear.weight.dtype)
    if type(linear) is SwitchLinear:  # three rows, two experts each, as SwitchGLU calls it
        indices = mx.random.randint(0, linear.num_experts, (1, 3, 2), key=mx.random.key(1))
        x = x.reshape(1, 3, 1, 1, -1)
        return relative_error(linear(x, indices), swapped(x, indices))
    return relative_error(linear(x), swapped(x))  # evaluates the transposed weight too
