"""The ``speculant`` command: ``generate``, ``chat``, ``validate``, ``check``, ``plugins``, ``bench``,
``train``, ``serve``, ``export`` and ``pull``.

Text goes to stdout, statistics and diagnostics to stderr. speculant's own errors print one
line (or a short list) and exit 2, any other error one line and exit 1; ``--debug`` (or
``SPECULANT_DEBUG=1``) shows the traceback instead. Ctrl-C ends generation with what was
produced, prints the statistics and exits 130. Other libraries' logging and warnings stay off the
terminal (speculant.core.quiet); ``-v``/``--verbose`` or ``--debug`` shows them. A reader that goes
away (``| head``) ends the command quietly with 141, as SIGPIPE would; a stdout that cannot be
written (full, closed) is one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import asdict
from typing import Any, Sequence

from speculant import __version__
from speculant.core.config import EngineConfig
from speculant.core.errors import SpeculantError
from speculant.core.quiet import third_party_quiet
from speculant.cli_settings import (  # noqa: F401  (build_config, UsageError: the CLI's public helpers)
    OVERRIDES, StdoutError, StdoutGuard, UsageError, add_override_flags, build_config, embedded_config, load_registry,
    stdout_failed, warn,
)

INTERRUPTED_EXIT = 130
INTERRUPTED = threading.Event()  # set by Ctrl-C even where Python swallows the KeyboardInterrupt


# -- parser ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculant", description="Lossless speculative decoding.")
    parser.add_argument("--version", action="version", version=f"speculant {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' warnings")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of errors")
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show other libraries' warnings (transformers, torch, mlx)")
    common.add_argument("-p", "--plugin", action="append", default=[], metavar="MODULE",
                        help="also load this importable module as a plugin (repeatable)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", parents=[common], help="generate text, streaming it to stdout")
    gen.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt; - reads it from stdin")
    gen.add_argument("--config", metavar="FILE", help="engine config (.toml, .yaml, .json); flags override it")
    gen.add_argument("--json", action="store_true", help="print the statistics as JSON on stderr")
    gen.add_argument("--compare", action="store_true",
                     help="then decode the same prompt without the drafter and print the speed-up")
    add_override_flags(gen)
    chat = gen.add_argument_group("chat")
    chat.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    chat.add_argument("--system", metavar="TEXT", help="system message (with --chat)")
    chat.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                      help="pass enable_thinking to the chat template (with --chat)")
    gen.set_defaults(func=cmd_generate)

    val = sub.add_parser("validate", parents=[common], help="check a config and model pairing without loading weights")
    val.add_argument("config", metavar="CONFIG", help="engine config (.toml, .yaml, .json)")
    val.add_argument("--json", action="store_true", help="print the report as JSON")
    val.set_defaults(func=cmd_validate)

    plug = sub.add_parser("plugins", parents=[common], help="list plugins and what they registered")
    plug.add_argument("--json", action="store_true", help="print the list as JSON")
    plug.add_argument("--traceback", action="store_true", help="show the traceback of failed plugins")
    plug.add_argument("--check", action="store_true", help="exit 1 if any plugin failed to load")
    plug.set_defaults(func=cmd_plugins)

    _add_bench(sub, common)
    _add_check(sub, common)
    _add_train(sub)
    _add_serve(sub, common)
    _add_pull(sub, common)
    _add_chat(sub, common)
    return parser


def _add_chat(sub: Any, common: argparse.ArgumentParser) -> None:
    """``speculant chat``: in speculant.chat (a multi-turn session over the prefix cache)."""
    from speculant.chat import add_parser

    add_parser(sub, [common], add_override_flags)


def _add_pull(sub: Any, common: argparse.ArgumentParser) -> None:
    """``speculant pull``: in speculant.pairs.command (fetching and converting load nothing eagerly)."""
    from speculant.pairs.command import add_parser

    add_parser(sub, [common])


def _add_train(sub: Any) -> None:
    """``speculant train``: parser and commands live in speculant.training.command (its commands
    load torch lazily, so the CLI itself stays array-library free)."""
    from speculant.training import command

    command.add_parser(sub)


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    """``speculant bench``: parser and command live in speculant.bench.command (no array library)."""
    from speculant.bench.command import add_parser

    add_parser(sub, parents=[common])


def _add_serve(sub: Any, common: argparse.ArgumentParser) -> None:
    """``speculant serve`` / ``export``: in speculant.serve.command (the server's packages load lazily)."""
    from speculant.serve.command import add_parsers

    add_parsers(sub, [common], add_override_flags)


def _add_check(sub: Any, common: argparse.ArgumentParser) -> None:
    """``speculant check``: parser and command live in speculant.check (array libraries load lazily)."""
    from speculant.check import add_parser

    add_parser(sub, [common], add_override_flags)


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is None:
        raise UsageError("no prompt: give PROMPT, or - to read it from stdin")
    text = read_stdin() if args.prompt == "-" else args.prompt
    if not text:
        raise UsageError("the prompt is empty")
    return text


def read_stdin() -> str:
    """All of stdin as UTF-8 text, whatever the locale; bad bytes are the user's input error."""
    if sys.stdin is None:
        raise UsageError("PROMPT -: stdin is closed; give the prompt as an argument")
    stream = getattr(sys.stdin, "buffer", None)
    try:
        if stream is None:  # a replaced stdin (tests, embedding programs) that is already text
            return sys.stdin.read()
        text = stream.read().decode("utf-8")
        return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text-mode stdin
    except UnicodeDecodeError as exc:
        raise UsageError(f"stdin: the prompt is not valid UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
                         f"{exc.start}); convert it first, e.g. iconv -t UTF-8") from None


def apply_chat_template(tokenizer: Any, prompt: str, system: str | None, thinking: bool | None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("--chat: the target's tokenizer has no chat template; drop --chat or use a chat model")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    extra = {} if thinking is None else {"enable_thinking": thinking}
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    except Exception as exc:  # noqa: BLE001  the template's own refusal (raise_exception), in Jinja's types
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if system:
            raise UsageError(f"--system: the target's chat template refused the system message ({reason}); drop "
                             "--system and put the instructions in the prompt") from None
        raise UsageError(f"--chat: the target's chat template failed ({reason}); drop --chat") from None


# -- generate --------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from speculant.api import load_engine

    if not args.chat and (args.system is not None or args.thinking is not None):
        raise UsageError("--system and --thinking/--no-thinking need --chat")
    config = build_config(args)
    prompt = read_prompt(args)
    engine = load_engine(config, registry=load_registry(args))
    if INTERRUPTED.is_set():  # Ctrl-C while loading that Python swallowed (e.g. inside a __del__)
        raise KeyboardInterrupt
    for problem in engine.report.warnings if engine.report else []:
        warn(str(problem))
    if args.chat:
        prompt = apply_chat_template(engine.tokenizer, prompt, args.system, args.thinking)
    # a rendered chat template already holds the special tokens it needs
    if args.compare:
        if not engine.speculative:
            raise UsageError("--compare needs a drafter or --lookup (it compares speculative with plain decoding)")
        warm_up(engine, prompt, not args.chat)
    generation = stream(engine, prompt, add_special_tokens=not args.chat)
    stats = generation.stats
    if stats is not None:
        print(json.dumps(stats.as_dict()) if args.json else str(stats), file=sys.stderr)
    interrupted = stats is None or stats.stop_reason == "interrupted"
    if args.compare and not interrupted:
        compare(config, engine, prompt, not args.chat, generation, args.json)
    return INTERRUPTED_EXIT if interrupted else 0


def warm_up(engine: Any, prompt: str, add_special_tokens: bool) -> None:
    """A short untimed run, so first-call costs do not land on one side of the comparison."""
    engine.run(prompt, max_new_tokens=8, add_special_tokens=add_special_tokens)


def compare(config: EngineConfig, engine: Any, prompt: str, add_special_tokens: bool, generation: Any,
            as_json: bool) -> None:
    """Decode the same prompt with the same target and settings but no drafter; report both."""
    stats, speculative_ids = generation.stats, generation.token_ids
    plain = engine.without_drafter()
    warm_up(plain, prompt, add_special_tokens)
    # same length as the speculative run, so both decode rates cover the same positions
    result = plain.run(prompt, max_new_tokens=max(1, stats.new_tokens), add_special_tokens=add_special_tokens,
                       ignore_eos=True)
    plain_rate = result.stats.decode_tokens_per_s
    speed_up = stats.decode_tokens_per_s / plain_rate if plain_rate else float("nan")
    same = next((i for i, (a, b) in enumerate(zip(speculative_ids, result.token_ids)) if a != b),
                min(len(speculative_ids), len(result.token_ids)))  # length of the common prefix
    report = {"speculative_decode_tokens_per_s": stats.decode_tokens_per_s, "plain_decode_tokens_per_s": plain_rate,
              "speed_up": speed_up, "mean_acceptance_length": stats.mean_acceptance_length,
              "identical_tokens": same, "new_tokens": len(speculative_ids)}
    if as_json:
        print(json.dumps(report), file=sys.stderr)
        return
    print(f"plain decoding {plain_rate:.1f} tok/s, speculative {stats.decode_tokens_per_s:.1f} tok/s: "
          f"speed-up {speed_up:.2f}x at mean acceptance length {stats.mean_acceptance_length:.2f}", file=sys.stderr)
    if same == len(speculative_ids):
        print(f"identical output: all {same} tokens", file=sys.stderr)
    else:
        note = (" (bfloat16/float16 round a block forward and a one-token forward differently; "
                "--dtype float32 compares exactly)" if engine.backend.dtype_name in ("bfloat16", "float16") else "")
        print(f"outputs agree on the first {same} of {len(speculative_ids)} tokens{note}", file=sys.stderr)


def stream(engine: Any, prompt: str, add_special_tokens: bool = True):
    """Print chunks as they come; Ctrl-C ends generation and keeps what was produced. Returns the
    finished :class:`~speculant.core.engine.Generation` (its stats and token ids)."""
    chunks = engine.generate(prompt, add_special_tokens=add_special_tokens)
    ended_with_newline = True
    try:
        for chunk in chunks:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                ended_with_newline = chunk.text.endswith("\n")
            if INTERRUPTED.is_set():  # the KeyboardInterrupt itself was lost somewhere
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        chunks.close()  # runs the engine's cleanup, which records the stats
    except BaseException:  # e.g. stdout went away: free the engine before the error is reported
        chunks.close()
        raise
    if not ended_with_newline and sys.stdout.isatty():
        sys.stdout.write("\n")
    sys.stdout.flush()
    return chunks


# -- validate --------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    from speculant.api import validate

    report = validate(args.config, registry=load_registry(args))
    if args.json:
        data = {"config": args.config, "ok": report.ok, "problems": [asdict(p) for p in report.problems]}
        print(json.dumps(data, indent=2))
    else:
        print_report(report)
    return 0 if report.ok else 1


def print_report(report: Any) -> None:
    for p in report.errors + report.warnings:
        print(f"{p.severity}: {p.field}: {p.message}")
        if p.fix:
            print(f"    fix: {p.fix}")
    errors, warnings = len(report.errors), len(report.warnings)
    if not report.problems:
        print("ok: no problems found")
    else:
        print(f"{errors} error(s), {warnings} warning(s)")


# -- plugins ---------------------------------------------------------------------------------
def cmd_plugins(args: argparse.Namespace) -> int:
    registry = load_registry(args)
    if args.json:
        print(json.dumps([p.as_dict() for p in registry.plugins], indent=2))
    else:
        for record in registry.plugins:
            print_plugin(record, args.traceback)
    return 1 if args.check and registry.failed_plugins() else 0


def print_plugin(p: Any, show_traceback: bool) -> None:
    origin = "builtin" if p.distribution == "builtin" else p.distribution
    status = f"failed: {p.error}" if p.status == "failed" else p.status
    print(f"{p.name} ({origin} {p.version}): {status}")
    print(f"    module: {p.module}" + (f" at {p.location}" if p.location else ""))
    if p.hooks:
        print(f"    hooks: {', '.join(p.hooks)}")
    for kind, names in p.registered.items():
        print(f"    {kind}: {', '.join(names)}")
    if show_traceback and p.traceback:
        print("    " + p.traceback.rstrip().replace("\n", "\n    "))


# -- entry point -----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    real_stdout = sys.stdout
    sys.stdout = StdoutGuard(real_stdout)
    try:
        return _main(argv)
    except StdoutError as exc:
        return stdout_failed(exc.error, real_stdout)
    finally:
        if isinstance(sys.stdout, StdoutGuard):
            sys.stdout = real_stdout


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("SPECULANT_DEBUG") == "1"
    restore = _watch_interrupts()
    try:
        with third_party_quiet(enabled=not (debug or getattr(args, "verbose", False))):
            return args.func(args)
    except StdoutError:
        raise
    except SpeculantError as exc:
        if debug:
            raise
        print(f"speculant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before generation started (e.g. while loading weights)
        print("speculant: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
    except Exception as exc:  # not one of speculant's own errors: still one line, not a traceback
        if debug:
            raise
        print(f"speculant: error: {type(exc).__name__}: {exc} (run with --debug for the traceback; "
              "if the input was valid, please report it)", file=sys.stderr)
        return 1
    finally:
        restore()


def _watch_interrupts():
    """Note every Ctrl-C in ``INTERRUPTED`` as well as raising KeyboardInterrupt: Python drops a
    KeyboardInterrupt raised inside a ``__del__`` or a callback, and the flag still ends the run."""
    INTERRUPTED.clear()
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored or default: leave it so
        return lambda: None

    def on_interrupt(signum, frame):
        INTERRUPTED.set()
        previous(signum, frame)

    signal.signal(signal.SIGINT, on_interrupt)
    return lambda: signal.signal(signal.SIGINT, previous)
