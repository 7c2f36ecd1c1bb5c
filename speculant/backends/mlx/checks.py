"""Pairing advice the MLX backend adds to the validator (warnings, never errors).

- Block size: MLX's quantized matmul kernels cost roughly in proportion to the number of rows
  they multiply, so with a quantized target or draft a verify block wider than 5 tokens tends
  to cost more than the extra accepted tokens bring (the reference MLX implementation gives the
  same advice).
- On the MLX CPU build, 4/8-bit weights with 16-bit activations run several times slower than
  with 32-bit activations (measured on Linux, mlx 0.32).
"""

from __future__ import annotations

from speculant.core.config import parse_quantization
from speculant.core.errors import ConfigError
from speculant.core.problems import Problem

QUANTIZED_BLOCK_ADVICE = 5


def _draft_quantized(config) -> bool:
    try:
        q = parse_quantization(config.drafter.quantization)
    except ConfigError:
        return False
    return q is not None and q.weight_bits is not None


def runtime_block(config, drafter) -> int | None:
    if config.drafter.block_size is not None:
        return config.drafter.block_size
    if drafter is None:
        return None
    return drafter.block_limit


def block_size_warning(config, target, drafter) -> Problem | None:
    quantized = [what for what, yes in (("target", bool(target.quantization)), ("draft", _draft_quantized(config))) if yes]
    block = runtime_block(config, drafter)
    if not quantized or block is None or block <= QUANTIZED_BLOCK_ADVICE:
        return None
    what = " and ".join(quantized)
    return Problem(
        "drafter.block_size",
        f"a verify block of {block} tokens with a quantized {what} on MLX: the cost of MLX's quantized matmul "
        f"grows with the verify width, so blocks above {QUANTIZED_BLOCK_ADVICE} usually verify slower than the extra "
        "accepted tokens gain",
        f"set drafter.block_size to {QUANTIZED_BLOCK_ADVICE} or less (measure with the benchmark to be sure)",
        severity="warning",
    )


def cpu_activation_warning(config) -> Problem | None:
    try:
        q = parse_quantization(config.drafter.quantization)
    except ConfigError:
        return None
    if q is None or q.weight_bits is None or q.activation_bits != 16 or config.backend.device == "gpu" or _has_metal():
        return None
    return Problem(
        "drafter.quantization.activation_bits",
        "16-bit activations with quantized weights run several times slower than 32-bit ones on MLX's CPU build",
        f"use 'w{q.weight_bits}a32:gs{q.group_size}' on a machine without Metal",
        severity="warning",
    )


def _has_metal() -> bool:
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:
        return False


def check_pairing(config, target, drafter) -> list[Problem]:
    if config.backend.kind != "mlx" or not config.drafter.enabled:
        return []
    found = [block_size_warning(config, target, drafter), cpu_activation_warning(config)]
    return [p for p in found if p is not None]
