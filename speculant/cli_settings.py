"""What every command that loads an engine shares: the settings flags, how they apply on top of a
config file (or a named model pair), the plugin registry a command uses, and its errors and warnings."""

from __future__ import annotations

import argparse
import errno
import math
import os
import sys
from typing import Any

from speculant.core.config import MIN_TEMPERATURE, EngineConfig
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


BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


class UsageError(SpeculantError):
    """The command line is inconsistent (e.g. no prompt, no model)."""


def add_override_flags(gen: argparse.ArgumentParser) -> None:
    add_pair_flag(gen)
    g = gen.add_argument_group("settings (override the config file)")
    g.add_argument("--target", metavar="DIR", help="target model folder")
    g.add_argument("--draft", metavar="DIR", help="drafter checkpoint folder (kind defaults to dflash)")
    g.add_argument("--drafter", metavar="KIND", help="drafter kind, or none for plain decoding")
    g.add_argument("--block-size", type=int, metavar="N", help="draft block size (anchor + proposals)")
    g.add_argument("--temperature", type=temperature, metavar="T", help=f"0 = greedy, else at least {MIN_TEMPERATURE:g}")
    g.add_argument("--top-p", type=finite_float, metavar="P")
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
    from speculant.pairs import DEFAULT_PAIR, PAIR_ENV, PAIRS

    parser.add_argument("--pair", choices=sorted(PAIRS), metavar="NAME",
                        help=f"the named model pair to run with no --config/--target: {', '.join(sorted(PAIRS))} "
                             f"(default ${PAIR_ENV}, else {DEFAULT_PAIR}; smollm2 is fetched and converted once, "
                             "see `speculant pull`; tiny needs no network)")


def finite_float(text: str) -> float:
    """An argparse type: a finite float (``nan`` and ``inf`` are refused on the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def temperature(text: str) -> float:
    """An argparse type: 0 (greedy) or a temperature from ``MIN_TEMPERATURE`` on."""
    value = finite_float(text)
    if value < 0 or 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"{text} is out of range: use 0 for greedy decoding or a temperature of at "
                                         f"least {MIN_TEMPERATURE:g}")
    return value


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
    """No config and no --target: the named pair (``--pair``, else ``$SPECULANT_PAIR``, else
    SmolLM2), its target pulled first where it is not cached."""
    from speculant import embedded, pairs

    try:
        name = getattr(args, "pair", None) or pairs.default_pair()
    except pairs.PullError as exc:
        raise UsageError(str(exc)) from None
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


# -- stdout -----------------------------------------------------------------------------------
class StdoutError(Exception):
    """Writing to stdout failed (its reader left, the disk is full, it is closed): not a bug."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class StdoutGuard:
    """``sys.stdout`` while a command runs: a failed write raises :class:`StdoutError`, so the
    command ends with one line (or quietly for a broken pipe) wherever the write was."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._call("write", text)

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args: Any) -> Any:
        if self._stream is None:  # started with stdout closed (>&-)
            raise StdoutError(OSError(errno.EBADF, os.strerror(errno.EBADF)))
        try:
            return getattr(self._stream, name)(*args)
        except OSError as exc:
            raise StdoutError(exc) from None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def stdout_failed(error: OSError, stream: Any) -> int:
    """Report a stdout that cannot be written; keep the interpreter's own final flush quiet."""
    if stream is not None and stream is sys.__stdout__:
        try:  # the unwritten buffer would fail again at exit: send it nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
    if isinstance(error, BrokenPipeError):
        return BROKEN_PIPE_EXIT
    print(f"speculant: error: cannot write to stdout: {error.strerror or error}", file=sys.stderr)
    return 1
