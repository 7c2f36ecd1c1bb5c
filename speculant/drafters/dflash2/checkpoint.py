"""DFlash2 checkpoint contract: required config keys and the published tensor layout.

The DFlash v1 tensors plus, per layer, ``{attention_conv,mlp_conv}.base_kernel`` [2, K, H] and
``{attention_conv,mlp_conv}.kernel_projection.weight`` [2*K*H/group, H], and
``candidate_selector.hidden_projection.weight`` [rank, H] with the two codebooks [V, rank].
The codebooks are published **without** a ``.weight`` suffix; converted checkpoints sometimes
carry it. Either spelling is accepted, a file holding both is refused.
"""

from __future__ import annotations

from pathlib import Path

from speculant.core.checkpoint import read_json_object, tensor_inventory
from speculant.core.errors import CheckpointError, ConfigError
from speculant.core.problems import Problem
from speculant.drafters.dflash.config import DFlashConfig, check_tensors, expected_tensors

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
# Keys the published DFlash2 config carries in dflash_config that parse_config would otherwise
# default (block_size -> 16, target_layer_ids -> the evenly spaced rule) or leave optional.
REQUIRED_DFLASH_KEYS = ("block_size", "target_layer_ids")
REQUIRED_TOP_LEVEL_KEYS = ("vocab_size",)
WHERE = "drafter.path"


def codebook_spelling(names) -> tuple[str, list[Problem]]:
    """``""`` (published, bare) or ``".weight"``, and a problem per codebook stored both ways."""
    names = set(names)
    problems = [Problem(f"{WHERE} ({name})", f"the checkpoint holds both {name} and {name}.weight",
                        "keep exactly one spelling of each codebook (the published files use no .weight suffix)")
                for name in CODEBOOKS if name in names and name + ".weight" in names]
    suffixed = any(name + ".weight" in names and name not in names for name in CODEBOOKS)
    return (".weight" if suffixed else ""), problems


def dflash2_tensors(cfg: DFlashConfig, codebook_suffix: str = "") -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of the published DFlash2 layout."""
    H, K = cfg.hidden_size, cfg.conv_kernel_size
    groups = H // cfg.conv_group_size
    out = expected_tensors(cfg)
    for i in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, K, H)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * K * groups, H)
    out["candidate_selector.hidden_projection.weight"] = (cfg.selector_rank, H)
    for name in CODEBOOKS:
        out[name + codebook_suffix] = (cfg.vocab_size, cfg.selector_rank)
    return out


def check_dflash2_tensors(path: str | Path, cfg: DFlashConfig) -> list[Problem]:
    """Header-only check of a DFlash2 folder; every problem names the tensor."""
    try:
        names = tensor_inventory(path)
    except CheckpointError as exc:
        return [Problem(WHERE, str(exc), "re-download or re-save the draft weights")]
    suffix, problems = codebook_spelling(names)
    return problems + check_tensors(path, cfg, dflash2_tensors(cfg, suffix))


def check_dflash2_config(path: str | Path) -> list[Problem]:
    """Problems parse_config does not raise for DFlash2: keys it would default silently."""
    try:
        raw = read_json_object(Path(path) / "config.json")
    except ConfigError:
        return []  # parse_config reports an unreadable config.json
    nested = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
    problems = [Problem(f"{WHERE} (dflash_config.{key})", f"the DFlash2 config lacks dflash_config.{key}",
                        f"add {key} to dflash_config in the draft's config.json")
                for key in REQUIRED_DFLASH_KEYS if key not in nested and key not in raw]
    problems += [Problem(f"{WHERE} ({key})", f"the DFlash2 config lacks {key} (the selector codebooks are [{key}, rank])",
                         f"add {key} to the draft's config.json")
                 for key in REQUIRED_TOP_LEVEL_KEYS if not isinstance(raw.get(key), int)]
    return problems


def check_dflash2_values(cfg: DFlashConfig) -> list[Problem]:
    """Range checks on the parsed DFlash2 keys."""
    problems = []
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if getattr(cfg, key) < 1:
            problems.append(Problem(f"{WHERE} (dflash_config.{key})", f"{key} is {getattr(cfg, key)}, must be at least 1",
                                    "use the value the draft was trained with"))
    if cfg.vocab_size and cfg.selector_top_k > cfg.vocab_size:
        problems.append(Problem(f"{WHERE} (dflash_config.selector_top_k)",
                                f"selector_top_k {cfg.selector_top_k} exceeds vocab_size {cfg.vocab_size}",
                                "use the value the draft was trained with"))
    return problems
