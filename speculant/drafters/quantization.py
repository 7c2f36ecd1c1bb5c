"""In-memory draft quantization from a spec like ``w4a16:gs64``: pairing checks and application.

- weight bits 2 / 4 / 8: affine integer weights with one scale and offset per group of
  ``group_size`` (32 / 64 / 128) input columns;
- activation bits 16: the draft computes in bfloat16 (float16 on a float16 backend); 32: float32.

MLX quantizes with ``mlx.nn.quantize`` (linear and embedding layers), PyTorch with torchao's
``IntxWeightOnlyConfig`` (linear and embedding layers; dequantizes on the fly, runs on CPU and
CUDA). Modules that :func:`default_exclude` names stay in float: DFlash2's selector and the
dynamic convolution kernels, whose bilinear/conv math is sensitive to rounding. A drafter can pass
its own predicate through ``DrafterInfo.extra["quantize_exclude"]`` (a ``path -> bool`` callable
over module paths such as ``layers.0.attention_conv.kernel_projection``). A spec ending in
``:all`` (``quantize_all``) quantizes those too, the selector's codebook tables included: the
drafter holds them as embedding layers first, grouped along the rank, so the rank must be a
multiple of the group size.

Quantization changes which tokens the draft proposes, never the output: verification is
against the unquantized target.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Iterable

from speculant.core.checkpoint import tensor_inventory
from speculant.core.config import QUANTIZATION_CHOICES, QuantizationConfig, parse_quantization
from speculant.core.errors import CheckpointError, ConfigError
from speculant.core.problems import Problem
from speculant.plugin_api import hookimpl

Exclude = Callable[[str], bool]
BACKENDS = ("mlx", "torch")
FIELD = "drafter.quantization"


def default_exclude(path: str) -> bool:
    """Keep selector codebooks and convolution-kernel modules (``*_conv.*``) in float."""
    parts = path.split(".")
    return any("codebook" in p for p in parts) or any(p == "conv" or p.endswith("_conv") for p in parts)


def resolve(spec) -> QuantizationConfig | None:
    """The parsed spec, or None when quantization is off."""
    q = parse_quantization(spec)
    return None if q is None or q.weight_bits is None else q


def activation_dtype(q: QuantizationConfig, backend_dtype: str) -> str:
    """The draft's compute dtype name for activation bits ``q.activation_bits``."""
    if q.activation_bits == 32:
        return "float32"
    return "float16" if backend_dtype == "float16" else "bfloat16"


def drafter_exclude(info) -> Exclude:
    """What the drafter keeps in float unless asked (``:all``): its own choice, else the default."""
    extra = getattr(info, "extra", None) or {}
    return extra.get("quantize_exclude") or default_exclude


def exclude_for(info, q: QuantizationConfig) -> Exclude:
    """What stays in float: nothing with ``q.quantize_all``, else :func:`drafter_exclude`."""
    return (lambda path: False) if q.quantize_all else drafter_exclude(info)


# -- checks (run by the validator before any weights load) ---------------------------------
def quantized_widths(folder, exclude: Exclude = default_exclude) -> dict[str, int]:
    """Input width of every weight matrix that quantization would touch, from safetensors headers.

    Codebook tables (stored bare or as ``*.weight``) count under their table name: a drafter
    quantizes them as embeddings, grouped along their last axis, when the exclusion allows.
    """
    widths = {}
    for name, (dtype, shape) in tensor_inventory(folder).items():
        module = name.removesuffix(".weight")
        is_table = "codebook" in module.rsplit(".", 1)[-1]
        if (name != module or is_table) and len(shape) == 2 and dtype.startswith(("F", "BF")) and not exclude(module):
            widths[module] = int(shape[-1])
    return widths


def _group_problem(q: QuantizationConfig, widths: dict[str, int]) -> Problem | None:
    bad = {m: w for m, w in widths.items() if w % q.group_size}
    if not bad:
        return None
    shown = ", ".join(f"{m} ({w})" for m, w in list(bad.items())[:4]) + (" ..." if len(bad) > 4 else "")
    fits = [g for g in QUANTIZATION_CHOICES["group_size"] if all(w % g == 0 for w in widths.values())]
    fix = (f"use a group size that divides every input width: {', '.join(map(str, fits))}" if fits
           else "this draft's layer widths fit no supported group size (32, 64, 128); remove drafter.quantization")
    return Problem(f"{FIELD}.group_size", f"group size {q.group_size} does not divide the input width of "
                   f"{len(bad)} draft weight(s): {shown}", fix)


def _backend_problems(q: QuantizationConfig, backend: str) -> list[Problem]:
    if backend not in BACKENDS:
        return [Problem(FIELD, f"in-memory draft quantization is implemented for the {' and '.join(BACKENDS)} "
                        f"backends, not {backend!r}", "remove drafter.quantization or use backend.kind 'mlx' or 'torch'")]
    if backend == "torch" and importlib.util.find_spec("torchao") is None:
        return [Problem(FIELD, "the torch backend quantizes drafts with torchao, which is not installed",
                        "pip install 'speculant[torch]' (brings torchao), or remove drafter.quantization")]
    return []


def check_quantization(config, target, drafter) -> list[Problem]:
    """Problems with ``drafter.quantization`` for this backend and draft checkpoint."""
    if not config.drafter.enabled:
        return []
    try:
        q = resolve(config.drafter.quantization)
    except ConfigError:
        return []  # the core validator already reports an unparsable spec
    if q is None or any(getattr(q, k) not in allowed for k, allowed in QUANTIZATION_CHOICES.items()):
        return []  # off, or out-of-range values the core validator already lists
    problems = _backend_problems(q, config.backend.kind)
    if config.drafter.path is not None and drafter is not None:
        problems += _width_problems(config.drafter.path, drafter, q)
    return problems


def _width_problems(folder, drafter, q: QuantizationConfig) -> list[Problem]:
    try:
        problem = _group_problem(q, quantized_widths(folder, exclude_for(drafter, q)))
    except CheckpointError:
        return []  # the drafter's own checks report unreadable weights
    if problem is None:
        return []
    if q.quantize_all and _group_problem(q, quantized_widths(folder, drafter_exclude(drafter))) is None:
        problem = Problem(problem.field, problem.message, f"{problem.fix}; or drop ':all' (quantize_all) so "
                          "the selector and convolutions stay in float")
    return [problem]


@hookimpl
def check_pairing(config, target, drafter):
    return check_quantization(config, target, drafter)


# -- application ---------------------------------------------------------------------------
def _targets(named: Iterable[tuple[str, object]], is_candidate, exclude: Exclude, group_size: int) -> list[str]:
    chosen, bad = [], []
    for path, module in named:
        if not path or not is_candidate(module) or exclude(path):
            continue
        width = int(module.weight.shape[-1])
        if width % group_size:
            bad.append(f"{path} ({width})")
        else:
            chosen.append(path)
    if bad:
        raise ValueError(f"cannot quantize the draft with group size {group_size}: it does not divide the input "
                         f"width of {', '.join(bad[:4])}; choose a group size that divides them")
    return chosen


def quantize_mlx(model, q: QuantizationConfig, exclude: Exclude = default_exclude) -> list[str]:
    """Quantize ``model``'s linear/embedding layers in place with ``mlx.nn.quantize``; returns their paths.

    Cast the model to its compute dtype first: scales and offsets take the weights' dtype.
    """
    import mlx.nn as nn

    chosen = set(_targets(model.named_modules(), lambda m: hasattr(m, "to_quantized") and hasattr(m, "weight"),
                          exclude, q.group_size))
    nn.quantize(model, group_size=q.group_size, bits=q.weight_bits, class_predicate=lambda path, m: path in chosen)
    return sorted(chosen)


def quantize_torch(model, q: QuantizationConfig, exclude: Exclude = default_exclude) -> list[str]:
    """Weight-only quantize ``model``'s ``nn.Linear`` and ``nn.Embedding`` layers in place with torchao;
    returns their paths."""
    import logging

    import torch

    logging.getLogger("torchao").setLevel(logging.ERROR)  # optional CUDA kernels it cannot load on CPU
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup, quantize_

    chosen = set(_targets(model.named_modules(), lambda m: isinstance(m, (torch.nn.Linear, torch.nn.Embedding)), exclude, q.group_size))
    config = IntxWeightOnlyConfig(weight_dtype=getattr(torch, f"int{q.weight_bits}"), granularity=PerGroup(q.group_size))
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in chosen)
    return sorted(chosen)
