"""Registers the DFlash2 drafter (candidate path selector + dynamic short convolution)."""

from __future__ import annotations

import dataclasses

from speculant.core.types import DrafterInfo, ProposalKind
from speculant.drafters.dflash.plugin import DFlashFactory
from speculant.plugins.hookspecs import hookimpl


class DFlash2Factory(DFlashFactory):
    """Reads and validates ``DFlash2DraftModel`` checkpoints; loads them on PyTorch.

    Runtime block: 2..trained block; the default is the trained block.
    """

    name = "dflash2"
    backends = ("torch",)
    architecture = "DFlash2DraftModel"

    def describe(self, config, target, backend):
        from speculant.drafters.dflash2.checkpoint import check_dflash2_config, check_dflash2_values

        early = check_dflash2_config(config.path) if config.path is not None else []
        info, problems = super().describe(config, target, backend)
        seen = {p.field for p in problems}
        problems = [p for p in early if p.field not in seen] + problems
        if info is not None:
            problems += check_dflash2_values(info.extra["config"])
        return info, problems

    def check_tensors(self, path, cfg):
        from speculant.drafters.dflash2.checkpoint import check_dflash2_tensors

        return check_dflash2_tensors(path, cfg)

    def info(self, cfg) -> DrafterInfo:
        return dataclasses.replace(
            super().info(cfg),
            max_block_size=cfg.block_size,
            proposal_kinds=(ProposalKind.ONE_HOT, ProposalKind.SPARSE),
            can_sample=True,
        )

    def load(self, config, info, backend, target):
        if backend.name == "torch":
            from speculant.drafters.dflash2.torch_loader import load_torch_dflash2

            return load_torch_dflash2(config, info, backend, target)
        raise ValueError(f"the dflash2 drafter does not support the {backend.name} backend")


@hookimpl
def register_drafters(register):
    register(DFlash2Factory())
