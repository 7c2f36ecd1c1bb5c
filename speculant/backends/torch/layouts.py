"""The CPU's layout of a PyTorch model's linear weights, chosen at load: as loaded
(``nn.Linear``), stored transposed (transposed.py) or packed for oneDNN (packed.py).

Which is fastest depends on the CPU and on the model: on an Intel Xeon with AVX-512 (one
thread), over the 57 layers of a 25M-parameter target in turn, packed products ran 1.08x as fast
as dense ones and transposed ones 0.95x, while over the 5M-parameter shipped target transposed
ones won; on a 2-core AMD EPYC packing took 25 % off a verify block. So under ``auto`` all of them
are timed over the model's own layers (core/timing.py) and the fastest is kept if it beats the
weights as loaded by ``timing.MARGIN``; under ``on`` (compiled forwards) likewise: the compiled
graphs run over either layout.
A drafter's layers follow its target's choice (``TargetModel.prepare_draft``).
"""

from __future__ import annotations

import torch
from torch import nn

from speculant.backends.torch.packed import (PackedLinear, dense_copies, drop_dense_copies, linear_layers,
                                              pack_linears, pack_problem, packed_product)
from speculant.backends.torch.transposed import TransposedLinear, transpose_linears
from speculant.core import timing

# Rows the layouts are timed on: a verify block's, what a speculative cycle's target forward and
# draft run. Over the mid target's layers in turn, one row ranked them otherwise (transposed 5.2,
# packed 7.0, dense 7.8 ms) than 8 rows (packed 11.5, dense 14.9, transposed 16.6 ms), and a
# sum of both hid packing's 23 % gain on the verify block (benchmarks/cpu_layouts.py).
MEASURED_ROWS = (8,)
# name: (the layer it makes of an nn.Linear, lay a module out, how fast_path says it)
LAYOUTS = {"transposed": (TransposedLinear, transpose_linears, "stored transposed"),
           "packed": (PackedLinear, pack_linears, "packed for oneDNN")}


def lay_out(model: nn.Module, dtype: torch.dtype, compiled: bool = False) -> tuple[str | None, str]:
    """Lay ``model``'s linear weights out for the CPU as measured fastest here (``compiled``: for
    compiled forwards), if any layout beats them as loaded: (layout, what was done), or (None, why
    not) with the model left as it was."""
    if dtype != torch.float32:
        return None, f"CPU weight layouts are float32 only, not {str(dtype).removeprefix('torch.')}"
    linears = [linear for *_, linear in linear_layers(model)]
    if not linears:
        return None, "no nn.Linear layers to lay out"
    kinds = ["transposed"] + (["packed"] if pack_problem(torch.device("cpu"), dtype) is None else [])
    key = {**library_key(linears, dtype), "compiled": compiled, "kinds": kinds}
    gains = timing.remembered("torch layouts", key, lambda: measured_speedups(linears, kinds, compiled=compiled))
    del linears  # the originals go as they are swapped out, not when this returns
    kind = max(gains, key=gains.get)
    if not gains[kind] >= timing.MARGIN:
        said = ", ".join(f"{name} {gain:.2f}x" for name, gain in gains.items())
        return None, f"no CPU weight layout was measured faster than dense weights on this CPU ({said})"
    count, problem = LAYOUTS[kind][1](model)
    if problem is not None:
        return None, problem
    one_row = settle_one_row(model, compiled) if kind == "packed" else ""
    return kind, laid_out(model, kind, count) + one_row


def lay_out_like(module: nn.Module, kind: str, one_row_dense: bool = True) -> str:
    """A drafter's modules laid out as its target's (``kind``; ``one_row_dense``: whether the
    target kept dense copies for one-row products): a fast_path for an eager draft."""
    count, problem = LAYOUTS[kind][1](module)
    if problem is None and kind == "packed" and not one_row_dense:
        drop_dense_copies(module)
    return f"eager: {problem}" if problem else f"eager; {laid_out(module, kind, count)}"


@torch.inference_mode()
def settle_one_row(model: nn.Module, compiled: bool = False) -> str:
    """Keep the dense copies packed layers hold for one-row products (plain decoding, packed.py)
    only if those products run faster than packed ones here by ``timing.MARGIN``, else drop them
    and their memory: on a 2-core AMD EPYC, SmolLM2-135M's 210 dense copies made a one-row
    forward 36 ms against 24 ms packed (2026-12-05), where a smaller model's had won. Returns
    what fast_path adds when they go."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.dense is not None]
    if not layers:
        return ""
    sample = timing.working_set(layers, lambda m: m.dense.numel() * m.dense.element_size())
    xs = {m.in_features: torch.randn(1, m.in_features, dtype=m.dense.dtype) for m in sample}

    def packed(m: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        return packed_product(x, m.packed, m.bias) if compiled else m.packed_forward(x)

    def measure() -> float:
        return timing.speedup(lambda: [packed(m, xs[m.in_features]) for m in sample],
                              lambda: [nn.functional.linear(xs[m.in_features], m.dense, m.bias) for m in sample])

    key = {**library_key(layers, layers[0].dense.dtype), "compiled": compiled}
    gain = timing.remembered("torch one-row packed", key, measure)
    if gain >= timing.MARGIN:
        return ""
    drop_dense_copies(model)
    return f"; one-row products packed too (dense ones measured {gain:.2f}x as fast)"


def library_key(layers: list[nn.Module], dtype: torch.dtype) -> dict:
    """What a layout's timing depends on here besides the CPU (core/timing.py remembers it)."""
    shapes = [[layer.in_features, layer.out_features, layer.bias is not None] for layer in layers]
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "shapes": shapes,
            "dtype": str(dtype)}


def laid_out(model: nn.Module, kind: str, count: int) -> str:
    """What was done to ``model``'s ``count`` layers, with the memory a packed layout keeps twice."""
    copies, size = dense_copies(model)
    kept = f" ({copies} also dense for one-row products, {size / 2**20:.3g} MiB)" if copies else ""
    return f"{count} linear layers {LAYOUTS[kind][2]}{kept}"


@torch.inference_mode()
def measured_speedups(linears: list[nn.Linear], kinds: list[str], compiled: bool = False) -> dict[str, float]:
    """Dense time over each layout's, over ``linears`` in order up to the working set
    (core/timing.py), each run on a verify block's rows; ``compiled``: packed products as a
    compiled graph runs them, through ``packed.packed_product``."""
    sample = timing.working_set(linears, lambda d: d.weight.numel() * d.weight.element_size())
    xs = {(rows, d.in_features): torch.randn(rows, d.in_features, dtype=d.weight.dtype)
          for d in sample for rows in MEASURED_ROWS}

    def run(layers):
        return lambda: [layer(xs[rows, layer.in_features]) for rows in MEASURED_ROWS for layer in layers]

    # each layout against dense on its own: timed interleaved with packed products, transposed ones
    # on the shipped target measured 0.92x of dense, alone 1.34-1.50x, as its decoding runs them
    return {kind: timing.speedup(run(sample), run([_as_run(kind, d, compiled) for d in sample])) for kind in kinds}


def _as_run(kind: str, linear: nn.Linear, compiled: bool) -> nn.Module:
    """``linear`` laid out as ``kind``, run as a compiled graph would run it. Inside a graph a
    packed product is a call to our own op, whose dispatch cost a small model notices: over the
    shipped 5M target's packed weights a compiled 8-row forward took 4.6 ms, 2.8 ms transposed."""
    layer = LAYOUTS[kind][0](linear)
    if compiled and kind == "packed":
        layer.as_compiled = True
    return layer
