"""Registers the DFlash2 drafter (candidate path selector + dynamic short convolution)."""

from __future__ import annotations

import dataclasses

from speculant.core.types import DrafterInfo, ProposalKind
from speculant.drafters.dflash.plugin import DFlashFactory
from speculant.plugin_api import hookimpl


MLX_DEFAULT_BLOCK = 5  # verify cost grows superlinearly with width on Metal (reference advice)


def quantize_exclude(path: str) -> bool:
    """Keep the whole selector (codebooks and its gate projection) and the convolutions in float."""
    from speculant.drafters.quantization import default_exclude

    return default_exclude(path) or path.split(".")[0] == "candidate_selector"


class DFlash2Factory(DFlashFactory):
    """Reads and validates ``DFlash2DraftModel`` checkpoints; loads them on PyTorch and MLX.

    Runtime block: 2..trained block. The default is the trained block on PyTorch and
    ``min(5, trained block)`` on MLX (``DrafterInfo.default_block_size``): verify cost grows
    with width there.
    """

    name = "dflash2"
    backends = ("torch", "mlx")
    architecture = "DFlash2DraftModel"

    def describe(self, config, target, backend):
        from speculant.drafters.dflash2.checkpoint import check_dflash2_config, check_dflash2_values

        early = check_dflash2_config(config.path) if config.path is not None else []
        info, problems = super().describe(config, target, backend)
        seen = {p.field for p in problems}
        problems = [p for p in early if p.field not in seen] + problems
        if info is not None:
            problems += check_dflash2_values(info.extra["config"])
            if backend == "mlx":
                info = dataclasses.replace(info, default_block_size=min(MLX_DEFAULT_BLOCK, info.trained_block_size))
        return info, problems

    def check_tensors(self, path, cfg):
        from speculant.drafters.dflash2.checkpoint import check_dflash2_tensors

        return check_dflash2_tensors(path, cfg)

    def info(self, cfg) -> DrafterInfo:
        info = super().info(cfg)
        return dataclasses.replace(
            info,
            max_block_size=cfg.block_size,
            proposal_kinds=(ProposalKind.ONE_HOT, ProposalKind.SPARSE),
            can_sample=True,
            extra={**info.extra, "quantize_exclude": quantize_exclude},
        )

    def load(self, config, info, backend, target):
        if backend.name == "torch":
            from speculant.drafters.dflash2.torch_loader import load_torch_dflash2

            return load_torch_dflash2(config, info, backend, target)
        if backend.name == "mlx":
            from speculant.drafters.dflash2.mlx import load_mlx_dflash2

            return load_mlx_dflash2(config, info, backend, target)
        raise ValueError(f"the dflash2 drafter does not support the {backend.name} backend")


@hookimpl
def register_drafters(register):
    register(DFlash2Factory())
