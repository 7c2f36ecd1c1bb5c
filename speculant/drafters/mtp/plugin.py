"""Registers the MTP drafter (a target's own multi-token-prediction layers) through the public hooks."""

from __future__ import annotations

from pathlib import Path

from speculant.core.interfaces import DrafterFactory
from speculant.core.types import DrafterInfo, ProposalKind
from speculant.core.problems import Problem
from speculant.drafters.mtp.config import MAX_BLOCK_SIZE, MTPOptions
from speculant.plugin_api import hookimpl


# mlx-lm model types whose sanitize() drops bundled MTP weights (mlx-lm 0.32)
# (a composite config's model_type is its text_config's: qwen3_5_text, qwen3_5_moe_text)
MLX_LOADERS_DROPPING_MTP = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "deepseek_v3",
                            "deepseek_v32", "glm4_moe", "glm4_moe_lite", "mimo")


class MTPFactory(DrafterFactory):
    """``drafter.kind = "mtp"``: weights in the target folder (``drafter.path`` unset) or in
    ``drafter.path``; embedding and LM head are always the target's."""

    name = "mtp"
    backends = ("torch", "mlx")
    options_model = MTPOptions

    def describe(self, config, target, backend):
        from pydantic import ValidationError

        from speculant.drafters.mtp.parse import parse_mtp

        try:
            options = MTPOptions.model_validate(config.options)
        except ValidationError:
            return None, []  # the validator reports invalid options (drafter.options) itself
        separate = config.path is not None and Path(config.path).resolve() != Path(target.path).resolve()
        folder = Path(config.path) if separate else Path(target.path)
        if separate and not folder.is_dir():
            return None, [Problem("drafter.path", f"{folder} is not a directory",
                                  "point drafter.path at the MTP weights, or leave it unset to use the target folder")]
        cfg, problems = parse_mtp(folder, target, options, separate)
        if cfg is None:
            return None, problems
        if backend == "mlx" and not separate and target.model_type not in MLX_LOADERS_DROPPING_MTP:
            problems.append(Problem("drafter.path", f"mlx-lm's {target.model_type} loader is strict and may reject the MTP "
                                    "tensors stored in the target folder",
                                    "if the target fails to load, move the MTP tensors and a config.json to their own "
                                    "folder and set drafter.path", severity="warning"))
        return self.info(cfg), problems

    def info(self, cfg) -> DrafterInfo:
        kinds = (ProposalKind.ONE_HOT, ProposalKind.DENSE) if cfg.sample_drafts else (ProposalKind.ONE_HOT,)
        return DrafterInfo(
            kind=self.name,
            final_hidden=cfg.hidden_tap,
            trained_block_size=cfg.num_layers + 1,  # one draft per MTP layer by default
            max_block_size=MAX_BLOCK_SIZE,
            backends=self.backends,
            proposal_kinds=kinds,
            can_sample=cfg.sample_drafts,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            extra={"config": cfg},
        )

    def load(self, config, info, backend, target):
        cfg = info.extra["config"]
        if backend.name == "torch":
            from speculant.drafters.mtp.torch import load_torch_network as load_network
        elif backend.name == "mlx":
            from speculant.drafters.mtp.mlx import load_mlx_network as load_network
        else:
            raise ValueError(f"the mtp drafter does not support the {backend.name} backend")
        from speculant.drafters.mtp.drafter import MTPDrafter

        return MTPDrafter(load_network(cfg, backend, target), info, backend)


@hookimpl
def register_drafters(register):
    register(MTPFactory())
