"""What every command that loads an engine shares: the settings flags, how they apply on top of a
config file (or the shipped pair), the plugin registry a command uses, and its errors and warnings."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from speculant.core.config import EngineConfig
from speculant.core.errors import SpeculantError

# generate flag (argparse dest) -> dotted config field it overrides
OVERRIDES = {
    "target": "target.path",
    "draft": "drafter.path",
    "drafter": "drafter.kind",
    "block_size": "drafter.block_size",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "seed": "sampling.seed",
    "max_new_tokens": "generation.max_new_tokens",
    "stop": "generation.stop_strings",
    "backend": "backend.kind",
    "device": "backend.device",
    "dtype": "backend.dtype",
    "verifier": "verifier.kind",
}


class UsageError(SpeculantError):
    """The command line is inconsistent (e.g. no prompt, no model)."""


def add_override_flags(gen: argparse.ArgumentParser) -> None:
    add_pair_flag(gen)
    g = gen.add_argument_group("settings (override the config file)")
    g.add_argument("--target", metavar="DIR", help="target model folder")
    g.add_argument("--draft", metavar="DIR", help="drafter checkpoint folder (kind defaults to dflash)")
    g.add_argument("--drafter", metavar="KIND", help="drafter kind, or none for plain decoding")
    g.add_argument("--block-size", type=int, metavar="N", help="draft block size (anchor + proposals)")
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy")
    g.add_argument("--top-p", type=float, metavar="P")
    g.add_argument("--top-k", type=int, metavar="K")
    g.add_argument("--seed", type=int, metavar="N")
    g.add_argument("--max-new-tokens", type=int, metavar="N")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--backend", metavar="KIND", help="torch or mlx")
    g.add_argument("--device", metavar="DEV", help="auto, cpu, cuda, cuda:N, mps, gpu")
    g.add_argument("--dtype", metavar="DTYPE", help="auto, float32, bfloat16, float16")
    g.add_argument("--verifier", metavar="KIND", help="auto, greedy, speculative_sampling, ...")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="prompt lookup: verify copies of what followed earlier occurrences of the last tokens")


def add_pair_flag(parser: argparse.ArgumentParser) -> None:
    from speculant.pairs import DEFAULT_PAIR, PAIRS

    parser.add_argument("--pair", choices=sorted(PAIRS), metavar="NAME",
                        help=f"the named model pair to run with no --config/--target: {', '.join(sorted(PAIRS))} "
                             f"(default {DEFAULT_PAIR}; smollm2 is fetched and converted once, see `speculant pull`)")


def load_registry(args: argparse.Namespace):
    from speculant.api import plugin_registry

    return plugin_registry(args.plugin)


def build_config(args: argparse.Namespace) -> EngineConfig:
    """The config file (paths relative to it) with the command-line flags applied on top."""
    if getattr(args, "pair", None) and (args.config or args.target):
        raise UsageError("--pair names a model pair to run without a config; drop it, or drop --config/--target")
    if args.config:
        data = EngineConfig.load(args.config).model_dump()
    elif args.target:
        data = {}
    else:
        data = embedded_config(args)
    for dest, dotted in OVERRIDES.items():
        value = getattr(args, dest)
        if value is not None:
            section, key = dotted.split(".")
            data.setdefault(section, {})[key] = value
    drafter = data.get("drafter", {})
    if args.draft and drafter.get("kind") in (None, ""):
        drafter["kind"] = "dflash"
    if args.lookup is not None:  # keeps min_match / max_match from the config file
        lookup = drafter.get("lookup")
        drafter["lookup"] = {**(lookup if isinstance(lookup, dict) else {}), "enabled": args.lookup}
        data["drafter"] = drafter
    return EngineConfig.load(data)


def embedded_config(args: argparse.Namespace) -> dict[str, Any]:
    """No config and no --target: the named pair (``--pair``; the one shipped with speculant by
    default), its target pulled first where it is not cached."""
    from speculant import embedded, pairs

    name = getattr(args, "pair", None) or pairs.DEFAULT_PAIR
    if name != "tiny":
        if args.draft:
            raise UsageError(f"--draft needs --target or --config (the {name} pair brings its own drafters)")
        try:
            return pairs.engine_config(name, args.drafter, backend=args.backend)
        except ValueError as exc:
            raise UsageError(f"--drafter: {exc}") from None
    if not embedded.available():
        raise UsageError("no model given and the shipped model pair is missing from this install: "
                         "pass --config engine.toml or --target MODEL_DIR")
    if args.draft:
        raise UsageError("--draft needs --target or --config (the shipped pair brings its own drafters)")
    try:
        return embedded.engine_config(args.drafter or embedded.DEFAULT_DRAFTER, backend=args.backend)
    except ValueError as exc:
        raise UsageError(f"--drafter: {exc}") from None


def warn(message: str) -> None:
    print(f"speculant: warning: {message}", file=sys.stderr)
