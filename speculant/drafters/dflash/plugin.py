"""Registers the DFlash drafter through the public hooks."""

from __future__ import annotations

import dataclasses

from speculant.core.interfaces import DrafterFactory
from speculant.core.problems import Problem
from speculant.core.types import DrafterInfo, ProposalKind
from speculant.plugin_api import hookimpl


class DFlashFactory(DrafterFactory):
    name = "dflash"
    backends = ("torch", "mlx")
    architecture = "DFlashDraftModel"

    def describe(self, config, target, backend):
        from speculant.drafters.dflash.config import parse_config

        if config.path is None:
            return None, [Problem("drafter.path", "the dflash drafter needs a checkpoint folder", "set drafter.path")]
        cfg, problems = parse_config(config.path, strict=backend == "mlx")
        if cfg is None:
            return None, problems
        if cfg.is_muse_glimmer:
            return self.describe_muse_glimmer(config, cfg, target)
        if cfg.architecture != self.architecture:
            other = "dflash2" if cfg.is_dflash2 else "dflash"
            return None, [Problem("drafter.kind", f"{config.path} is a {cfg.architecture} checkpoint",
                                  f"set drafter.kind = '{other}'")]
        return self.info(cfg), self.check_tensors(config.path, cfg)

    def describe_muse_glimmer(self, config, cfg, target):
        """A Muse Glimmer assistant: its target family, then its tensors."""
        from speculant.drafters.dflash import muse_glimmer

        if self.architecture != "DFlashDraftModel":
            return None, [Problem("drafter.kind", f"{config.path} is a {muse_glimmer.MODEL_TYPE} checkpoint",
                                  "set drafter.kind = 'dflash'")]
        problems = muse_glimmer.target_problems(target)
        if target is not None:
            cfg.num_target_layers = target.num_hidden_layers
        info = self.info(cfg)
        if muse_glimmer.final_feature(cfg) is not None:
            info = dataclasses.replace(info, final_hidden="post_norm")
        return info, problems + self.check_tensors(config.path, cfg)

    def check_tensors(self, path, cfg) -> list[Problem]:
        """Problems with the safetensors headers (names, shapes) against the expected layout."""
        from speculant.drafters.dflash.config import check_tensors

        return check_tensors(path, cfg, self.expected_tensors(cfg))

    def expected_tensors(self, cfg):
        from speculant.drafters.dflash import muse_glimmer
        from speculant.drafters.dflash.config import expected_tensors

        expected = expected_tensors(cfg)
        return muse_glimmer.disk_names(expected) if cfg.is_muse_glimmer else expected

    def info(self, cfg) -> DrafterInfo:
        return DrafterInfo(
            kind=self.name,
            target_layer_ids=tuple(cfg.target_layer_ids),
            trained_block_size=cfg.block_size,
            backends=self.backends,
            proposal_kinds=(ProposalKind.ONE_HOT,),
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            mask_token_id=cfg.mask_token_id,
            num_target_layers=cfg.num_target_layers,
            extra={"config": cfg},
        )

    def load(self, config, info, backend, target):
        if backend.name == "torch":
            from speculant.drafters.dflash.torch_loader import load_torch_drafter

            return load_torch_drafter(config, info, backend, target)
        if backend.name == "mlx":
            from speculant.drafters.dflash.mlx import load_mlx_drafter

            return load_mlx_drafter(config, info, backend, target)
        raise ValueError(f"the dflash drafter does not support the {backend.name} backend")


@hookimpl
def register_drafters(register):
    register(DFlashFactory())
