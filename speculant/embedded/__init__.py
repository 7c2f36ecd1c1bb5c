"""The model pair shipped with speculant: a small Qwen3 target trained on Python source code
with its DFlash, DFlash2 and MTP drafters (block size 8), so ``speculant generate "prompt"``
runs offline with no config. ``pair/MANIFEST.json`` records the corpus, token counts, training
settings and checksums; ``scripts/build_embedded_pair.sh`` reproduces every file.
"""

from __future__ import annotations

import importlib.util
import json
import platform
from pathlib import Path
from typing import Any

PAIR_DIR = Path(__file__).parent / "pair"
DRAFTERS = ("dflash2", "dflash", "mtp")
DEFAULT_DRAFTER = "dflash2"
# Measured on the shipped pair with benchmarks/embedded_pair.py (see the README): the block
# drafters pay only on predictable code, and the adaptive verifier keeps the rest at plain speed.
DEFAULT_VERIFIER = "adaptive"
# The shipped target often loops over text of its own invention, which no drafter predicts
# but the context holds: copies from it (drafter.lookup) lifted DFlash2's speed-up most there,
# and most with one-token matches (benchmarks/embedded_pair.py --lookup; README).
DEFAULT_LOOKUP = True
LOOKUP = {"min_match": 1, "max_match": 8}  # drafter.lookup settings beside ``enabled``


def available() -> bool:
    """True when the shipped weights are present (a source checkout or an installed wheel)."""
    return (PAIR_DIR / "MANIFEST.json").is_file() and (PAIR_DIR / "target" / "config.json").is_file()


def manifest() -> dict[str, Any]:
    return json.loads((PAIR_DIR / "MANIFEST.json").read_text())


def default_backend() -> str:
    """MLX on Apple Silicon when installed (Metal); otherwise PyTorch, else MLX."""
    has_mlx = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
    has_torch = importlib.util.find_spec("torch") is not None
    if has_mlx and platform.system() == "Darwin" and platform.machine() == "arm64":
        return "mlx"
    return "torch" if has_torch or not has_mlx else "mlx"


def engine_config(drafter: str | None = DEFAULT_DRAFTER, backend: str | None = None,
                  lookup: bool = DEFAULT_LOOKUP) -> dict[str, Any]:
    """An engine config dict for the shipped pair; ``drafter`` is a shipped kind or None/"none";
    ``lookup`` turns prompt lookup on beside the drafter."""
    backend = backend or default_backend()
    config: dict[str, Any] = {
        # auto: float32 on a CPU, exact and, measured, faster in tokens/s than bf16 (bf16 plain
        # decoding ran at half float32's rate on a CPU with avx512_bf16; docs/shipped-pair.md)
        "backend": {"kind": backend, "dtype": "auto"},
        "target": {"path": str(PAIR_DIR / "target")},
        "verifier": {"kind": DEFAULT_VERIFIER},
    }
    if drafter in (None, "none"):
        config["drafter"] = {"kind": "none"}
    elif drafter in DRAFTERS:
        config["drafter"] = {"kind": drafter, "path": str(PAIR_DIR / drafter),
                             "lookup": {"enabled": lookup, **LOOKUP}}
    else:
        raise ValueError(f"the shipped pair has drafters {', '.join(DRAFTERS)} (or none); got {drafter!r}")
    return config
