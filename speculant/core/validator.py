"""Compatibility checks for a model pairing, run from config files before any weights load.

Every check appends a :class:`Problem` naming the field and the fix; the report holds all of
them at once. Plugins add their own checks through the ``check_pairing`` hook.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import ValidationError

from speculant.core.checkpoint import read_json_object, tensor_inventory
from speculant.core.config import MIN_TEMPERATURE, QUANTIZATION_CHOICES, EngineConfig, SamplingConfig, parse_quantization
from speculant.core.errors import CheckpointError, ConfigError
from speculant.core.interfaces import Catalogue
from speculant.core.problems import Problem, Report
from speculant.core.schema import error_lines
from speculant.core.target_check import json_file_problems, target_tensor_problems
from speculant.core.types import DrafterInfo, ProposalKind, TargetInfo


def read_json(path: Path) -> dict:
    """A JSON object file; a ConfigError naming the file otherwise."""
    return read_json_object(path)


def text_config(raw: dict) -> dict:
    """VLM-style configs keep the language model's keys under ``text_config``."""
    inner = raw.get("text_config")
    return {**raw, **inner} if isinstance(inner, dict) else raw


def read_target_info(path: Path) -> TargetInfo:
    """Target facts from ``config.json`` (and ``generation_config.json`` for EOS ids)."""
    path = Path(path)
    raw = read_json(path / "config.json")
    cfg = text_config(raw)
    eos: list[int] = []
    for source in (cfg, _maybe_json(path / "generation_config.json")):
        value = source.get("eos_token_id")
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in eos:
                eos.append(v)
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers") if not isinstance(cfg.get(k), int)]
    if missing:
        raise ConfigError(f"{path / 'config.json'}: missing or non-integer {', '.join(missing)}; is this a causal LM folder?")
    return TargetInfo(
        path=str(path),
        model_type=str(cfg.get("model_type", "unknown")),
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        max_position_embeddings=cfg.get("max_position_embeddings"),
        eos_token_ids=tuple(eos),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        quantization=raw.get("quantization") or raw.get("quantization_config"),
        layer_types=layer_types(cfg),
        sliding_window=cfg.get("sliding_window") if isinstance(cfg.get("sliding_window"), int) else None,
        raw=raw,
    )


def layer_types(cfg: dict) -> tuple[str, ...]:
    """Each decoder layer's kind, as transformers names it, from a (text) config: its
    ``layer_types`` when written, else the family's older keys (``full_attention_interval``,
    ``sliding_window`` with ``use_sliding_window`` / ``max_window_layers``, ``sliding_window_pattern``)."""
    n = cfg["num_hidden_layers"]
    given = cfg.get("layer_types")
    if isinstance(given, list) and len(given) == n and all(isinstance(t, str) for t in given):
        return tuple(given)
    interval = cfg.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n))
    window = cfg.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or cfg.get("use_sliding_window") is False:
        return ("full_attention",) * n
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0:
        return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n))
    first = cfg.get("max_window_layers") if cfg.get("use_sliding_window") else 0
    first = first if isinstance(first, int) else 0
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def _maybe_json(path: Path) -> dict:
    """A JSON object file, or {} when absent or unreadable (the validator reports the latter)."""
    try:
        return read_json_object(path)
    except ConfigError:
        return {}


def validate(config: EngineConfig | dict | str | Path, catalogue: Catalogue) -> Report:
    """Check the whole pairing against what ``catalogue`` registered, without loading weights;
    never raises for a bad pairing (``speculant.validate`` supplies the installed plugins)."""
    config = EngineConfig.load(config)
    report = Report()
    add = report.problems.append
    _check_plugins(catalogue, add)

    backend_cls = catalogue.backends.get(config.backend.kind)
    if backend_cls is None:
        add(Problem("backend.kind", catalogue.missing_hint("backends", config.backend.kind), "use one of the registered backends"))
    else:
        reason = backend_cls.availability_problem()
        if reason:
            add(Problem("backend.kind", reason, f"pip install 'speculant[{config.backend.kind}]'"))
        if config.backend.dtype not in backend_cls.supported_dtypes():
            add(Problem("backend.dtype", f"{config.backend.dtype!r} is not supported by the {config.backend.kind} backend",
                        f"use one of {', '.join(backend_cls.supported_dtypes())}"))
        elif not reason:
            _check_device(config, backend_cls, add)

    target = _check_target(config, add)
    report.target = target
    if target is not None and backend_cls is not None:
        family = backend_cls.family_problem(target) if not backend_cls.availability_problem() else None
        if family:
            add(Problem("target.path", family, "check model_type in the target's config.json, or use a backend "
                        "(or library release) that has this family"))
        _check_rollback(config, target, backend_cls, add)
        _check_tree(config, target, backend_cls, add)
    _check_sampling(config, add)

    if target is not None:
        _check_stop_ids(config, target, add)
    drafter_info = None
    if config.drafter.enabled:
        drafter_info = _check_drafter(config, target, catalogue, add)
    else:
        _check_unused_drafter_settings(config, add)
    _check_lookup(config, add)
    _check_block_floor(config, add)
    report.drafter = drafter_info
    _check_verifier(config, drafter_info, catalogue, add)
    if target is not None:
        report.problems.extend(catalogue.check_pairing(config, target, drafter_info))
    return report


def _check_target(config: EngineConfig, add) -> TargetInfo | None:
    path = config.target.path
    if not path.is_dir():
        add(Problem("target.path", f"{path} is not a directory", "point target.path at a local model folder holding config.json and *.safetensors"))
        return None
    if not (path / "config.json").is_file():
        add(Problem("target.path", f"{path} has no config.json", "point target.path at a Hugging Face / mlx-lm model folder"))
        return None
    if not any(path.glob("*.safetensors")):
        add(Problem("target.path", f"{path} holds no *.safetensors weights (pickled .bin files are never loaded)",
                    "convert the weights to safetensors"))
    try:
        info = read_target_info(path)
    except ConfigError as exc:
        add(Problem("target.path", str(exc), "fix the target's config.json"))
        info = None  # the files are still checked: one bad file must not hide the others
    for message in json_file_problems(path):
        add(Problem("target.path", f"{path}: {message}", "fix the file, or download or copy it again with the model"))
    for message in target_tensor_problems(path, info):
        add(Problem("target.path", f"{path}: {message}", "download or copy the checkpoint again"))
    return info


def _check_rollback(config: EngineConfig, target: TargetInfo, backend_cls, add) -> None:
    """Speculative decoding rolls the target's caches back after every rejected block."""
    speculative = config.drafter.enabled or config.drafter.lookup.enabled
    reason = backend_cls.rollback_problem(target) if speculative else None
    if reason:
        other = "mlx" if config.backend.kind == "torch" else "torch"
        add(Problem("target.path", reason,
                    f"use a target family the {config.backend.kind} backend rolls back (or backend.kind = {other!r} "
                    "if it supports this one), or decode plainly (drafter.kind = 'none', no lookup)"))


def _check_tree(config: EngineConfig, target: TargetInfo, backend_cls, add) -> None:
    """The ``tree`` verifier verifies chains on a target whose layers take no tree: say so up front."""
    reason = backend_cls.tree_problem(target) if config.verifier.resolved_kind == "tree" else None
    if reason:
        add(Problem("verifier.kind", f"{reason}; the tree verifier verifies chains on this target",
                    "use verifier.kind = 'auto' for chains, or a target whose layers take a tree", severity="warning"))


def _check_sampling(config: EngineConfig, add) -> None:
    for problem in sampling_problems(config.sampling):
        add(problem)


def sampling_problems(s: SamplingConfig) -> list[Problem]:
    """What is wrong with sampling settings (a config's, or one call's overrides applied)."""
    problems = []
    if not (s.temperature >= 0 and math.isfinite(s.temperature)):
        problems.append(Problem("sampling.temperature", f"{s.temperature} is negative, infinite or NaN",
                                "use 0 for greedy decoding or a finite positive value"))
    elif 0 < s.temperature < MIN_TEMPERATURE:
        problems.append(Problem("sampling.temperature", f"{s.temperature} is below the smallest sampling temperature "
                                f"{MIN_TEMPERATURE:g} (the tempered logits would overflow or be greedy in all but name)",
                                f"use 0 for greedy decoding, or at least {MIN_TEMPERATURE:g}"))
    if not 0 < s.top_p <= 1:
        problems.append(Problem("sampling.top_p", f"{s.top_p} is outside (0, 1]",
                                "use a value in (0, 1]; 1 disables nucleus sampling"))
    if s.top_k < 0:
        problems.append(Problem("sampling.top_k", f"{s.top_k} is negative", "use 0 to disable top-k or a positive count"))
    if s.seed is not None and s.seed < 0:
        problems.append(Problem("sampling.seed", f"{s.seed} is negative", "use a non-negative integer, or leave it unset"))
    return problems


def _check_device(config: EngineConfig, backend_cls, add) -> None:
    """An explicit device must exist here: the backend resolves it now, not at load time."""
    if config.backend.device in ("auto", ""):
        return
    try:
        backend = backend_cls(config.backend)
        try:
            backend.int_array([0])  # the allocation fails for an absent device index (cuda:7 on one GPU)
        except (AttributeError, NotImplementedError):
            pass  # a backend that makes no arrays (a stub) has no device to probe
    except Exception as exc:  # each backend raises its own type for an unknown or absent device
        add(Problem("backend.device", f"{config.backend.device!r} cannot be used by the {config.backend.kind} "
                    f"backend here: {exc}", "use 'auto' or 'cpu', or a device this machine has"))


def _check_plugins(catalogue, add) -> None:
    """A plugin asked for by name (``-p MODULE``) that failed to load is an error. An installed
    one that failed only matters when a name it would register is used, which the kind checks
    report (with the failure) through ``missing_hint``."""
    for record in catalogue.failed_plugins():
        if record.distribution == "command line":
            add(Problem("plugins", f"plugin {record.source} failed to load: {record.error}",
                        "fix the module or drop -p (speculant plugins -p MODULE --traceback shows why)"))


def _check_options(section: str, kind: str, options_model, options: dict, add) -> None:
    """A plugin's options: checked by its model, or none allowed when it declares none."""
    if options_model is None:
        if options:
            add(Problem(f"{section}.options", f"the {kind} {section} takes no options; unknown key(s): "
                        f"{', '.join(map(str, options))}", f"remove {section}.options"))
        return
    try:
        options_model.model_validate(options)
    except ValidationError as exc:
        details = "; ".join(error_lines(exc, options_model))
        add(Problem(f"{section}.options", f"invalid options for {kind}: {details}",
                    f"see {section}.options in docs/configuration.md or the plugin's documentation"))
    except Exception as exc:  # a plugin's own validator may raise anything
        add(Problem(f"{section}.options", f"invalid options for {kind}: {exc}", f"see the {section}'s documentation"))


def _check_drafter(config: EngineConfig, target: TargetInfo | None, catalogue, add) -> DrafterInfo | None:
    d = config.drafter
    factory = catalogue.drafters.get(d.kind)
    if factory is None:
        add(Problem("drafter.kind", catalogue.missing_hint("drafters", d.kind), "install the plugin that provides it, or fix the name"))
        return None
    if config.backend.kind not in factory.backends:
        add(Problem("drafter.kind", f"the {d.kind} drafter does not support the {config.backend.kind} backend",
                    f"use backend.kind one of {', '.join(factory.backends)}"))
    _check_options("drafter", d.kind, factory.options_model, d.options, add)
    _check_quantization(config, add)
    if target is None:
        _check_draft_files(config, add)
        return None
    try:
        info, problems = factory.describe(d, target, config.backend.kind)
    except Exception as exc:  # a plugin's bug must not become the validator's traceback
        origin = catalogue.origin("drafters", d.kind)
        add(Problem("drafter.kind", f"the {d.kind} drafter ({origin}) raised {type(exc).__name__} while reading "
                    f"its checkpoint: {exc}", "report this to the plugin's authors, or use another drafter"))
        return None
    for p in problems:
        add(p)
    if info is None:
        return None
    if info.vocab_size is not None and info.vocab_size != target.vocab_size:
        add(Problem("drafter.path", f"draft vocab_size {info.vocab_size} != target vocab_size {target.vocab_size}",
                    "use a draft trained for this target (same tokenizer and vocabulary)"))
    if info.hidden_size is not None and info.hidden_size != target.hidden_size:
        add(Problem("drafter.path", f"draft hidden_size {info.hidden_size} != target hidden_size {target.hidden_size}",
                    "use a draft trained for this target"))
    if info.num_target_layers is not None and info.num_target_layers != target.num_hidden_layers:
        add(Problem("drafter.path", f"draft num_target_layers {info.num_target_layers} != target num_hidden_layers {target.num_hidden_layers}",
                    "use a draft trained for this target"))
    for layer_id in info.target_layer_ids:
        if not 0 <= layer_id < target.num_hidden_layers:
            add(Problem("drafter.path", f"target_layer_ids entry {layer_id} does not exist in the target (layers 0..{target.num_hidden_layers - 1})",
                        "use a draft trained for this target, or fix dflash_config.target_layer_ids"))
    if info.mask_token_id is not None and not 0 <= info.mask_token_id < target.vocab_size:
        add(Problem("drafter.path", f"mask_token_id {info.mask_token_id} is outside the target vocabulary (0..{target.vocab_size - 1})",
                    "fix dflash_config.mask_token_id"))
    block = d.block_size
    limit = info.block_limit
    if block is not None:
        if block >= 2 and limit is not None and block > limit:  # below 2: _check_block_floor
            add(Problem("drafter.block_size", f"{block} exceeds the draft's trained block size {limit}",
                        f"use a value between 2 and {limit}"))
    elif info.trained_block_size is None:
        add(Problem("drafter.block_size", "the draft checkpoint does not say its block size", "set drafter.block_size"))
    return info


def _check_stop_ids(config: EngineConfig, target: TargetInfo, add) -> None:
    outside = [t for t in config.generation.stop_token_ids if t >= target.vocab_size]
    if outside:
        add(Problem("generation.stop_token_ids", f"token id {outside[0]} is outside the target's vocabulary "
                    f"(vocab size {target.vocab_size})", f"use ids 0..{target.vocab_size - 1}"))


def _check_unused_drafter_settings(config: EngineConfig, add) -> None:
    """Drafter settings written with no drafter do nothing: say so rather than ignore them. A path
    beside ``kind = "none"`` is a drafter switched off and kept for later, not a slip."""
    d = config.drafter
    written = (("path", d.path if d.kind != "none" else None), ("quantization", d.quantization), ("options", d.options))
    unused = [name for name, value in written if value not in (None, {}, "", "off", "none")]
    if d.block_size is not None and not d.lookup.enabled:
        unused.append("block_size")
    for name in unused:
        add(Problem(f"drafter.{name}", f"is set but there is no drafter (drafter.kind is {d.kind or 'unset'})"
                    + (" and no prompt lookup" if name == "block_size" else "") + ", so it is not used",
                    "set drafter.kind, or remove the setting", severity="warning"))


def _check_draft_files(config: EngineConfig, add) -> None:
    """Without the target's facts a drafter cannot describe its checkpoint; the headers of the
    draft's own files are still read, so a bad target config.json hides no bad draft file."""
    path = config.drafter.path
    if path is None or not Path(path).is_dir() or Path(path).resolve() == config.target.path.resolve():
        return
    try:
        tensor_inventory(path)
    except CheckpointError as exc:
        add(Problem("drafter.path", str(exc), "re-download or re-save the draft weights"))


def _check_lookup(config: EngineConfig, add) -> None:
    lookup = config.drafter.lookup
    if lookup.enabled and lookup.min_match > lookup.max_match:
        add(Problem("drafter.lookup.min_match", f"min_match {lookup.min_match} exceeds max_match {lookup.max_match}",
                    "set drafter.lookup.min_match <= drafter.lookup.max_match"))


def _check_block_floor(config: EngineConfig, add) -> None:
    """A block is the anchor plus at least one proposal, from the drafter or copied by lookup."""
    d = config.drafter
    if (d.enabled or d.lookup.enabled) and d.block_size is not None and d.block_size < 2:
        add(Problem("drafter.block_size", f"{d.block_size} is below 2 (one anchor plus at least one proposal or "
                    "copied token)", "use a block size of at least 2"))


def _check_quantization(config: EngineConfig, add) -> None:
    try:
        q = parse_quantization(config.drafter.quantization)
    except ConfigError as exc:
        add(Problem("drafter.quantization", str(exc), "use e.g. 'w4a16:gs64'"))
        return
    if q is None or q.weight_bits is None:
        return
    for name, allowed in QUANTIZATION_CHOICES.items():
        value = getattr(q, name)
        if value not in allowed:
            add(Problem(f"drafter.quantization.{name}", f"{value} is not supported",
                        f"use one of {', '.join(map(str, allowed))}"))


def _check_verifier(config: EngineConfig, drafter: DrafterInfo | None, catalogue, add) -> None:
    kind = config.verifier.kind
    cls = catalogue.verifiers.get(config.verifier.resolved_kind)
    if cls is None:
        add(Problem("verifier.kind", catalogue.missing_hint("verifiers", kind), "use auto, greedy or speculative_sampling"))
        return
    if config.sampling.temperature > 0 and not cls.supports_sampling:
        add(Problem("verifier.kind", f"the {kind} verifier only supports greedy decoding but sampling.temperature is {config.sampling.temperature}",
                    "set verifier.kind = 'speculative_sampling' (or 'auto'), or sampling.temperature = 0"))
    if config.drafter.lookup.enabled and ProposalKind.ONE_HOT not in cls.accepts:
        add(Problem("drafter.lookup", f"prompt lookup proposes one-hot copies, which the {kind} verifier does not accept",
                    "turn drafter.lookup off, or use verifier.kind 'auto'"))
    if drafter is not None:
        wanted = [k for k in drafter.proposal_kinds if k not in cls.accepts]
        if wanted and config.sampling.temperature > 0:
            add(Problem("verifier.kind", f"the {kind} verifier does not accept {', '.join(k.value for k in wanted)} proposals from the {drafter.kind} drafter",
                        "use verifier.kind = 'speculative_sampling'"))
    _check_options("verifier", kind, cls.options_model, config.verifier.options, add)
