"""``speculant serve`` and ``speculant export``: parsers and commands (no array library imported here)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Callable

from speculant.serve import DEFAULT_HOST, DEFAULT_MAX_BATCH, DEFAULT_PORT


def add_parsers(sub: Any, parents: list, add_override_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = sub.add_parser("serve", parents=parents, help="serve an OpenAI-compatible HTTP API (needs [serve])")
    serve.add_argument("--config", metavar="FILE",
                       help="engine config (.toml, .yaml, .json); default: the default pair (--pair)")
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                            "(default: $SPECULANT_API_KEY)")
    serve.add_argument("--model-name", default="speculant", metavar="NAME", help="the model id clients pass")
    serve.add_argument("--max-queue", type=int, default=64, metavar="N",
                       help="requests that may wait for the engine; more get 429 (default 64)")
    serve.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, metavar="N",
                       help=f"requests verified together in one target forward a cycle (default {DEFAULT_MAX_BATCH}; "
                            "1: one at a time)")
    serve.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request limit in seconds")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="request body limit")
    add_override_flags(serve)
    serve.set_defaults(func=cmd_serve)

    export = sub.add_parser("export", parents=parents,
                            help="print the launch command of vLLM, SGLang, llama.cpp or oMLX for the same pairing")
    export.add_argument("--to", required=True, choices=["vllm", "sglang", "llama.cpp", "omlx"], help="the engine")
    export.add_argument("--config", metavar="FILE", help="engine config; default: the default pair (--pair)")
    add_override_flags(export)
    export.set_defaults(func=cmd_export)


def cmd_serve(args: argparse.Namespace) -> int:
    from speculant.cli_settings import UsageError, build_config, load_registry, warn
    from speculant.api import load_engine

    try:
        from speculant.serve import run
        from speculant.serve.listen import ListenError, bind, is_loopback
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"speculant serve needs the [serve] extra: pip install 'speculant[serve]' ({exc})") from None
    _check_limits(args, UsageError)
    api_key = _api_key(args, UsageError)
    try:  # before the weights load: a bad address or a taken port fails in a second, not a minute
        sock = bind(args.host, args.port)
    except ListenError as exc:
        raise UsageError(str(exc)) from None
    try:
        engine = load_engine(build_config(args), registry=load_registry(args))
        for problem in engine.report.warnings if engine.report else []:
            warn(str(problem))
        if not is_loopback(args.host) and not api_key:
            warn(f"serving on {args.host} without --api-key: anyone who can reach this port can use the model")
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"speculant: serving {args.model_name!r} on http://{shown}:{args.port}/v1", file=sys.stderr)
        run(engine, sock=sock, model_name=args.model_name, api_key=api_key, max_queue=args.max_queue,
            timeout=args.timeout, max_body_bytes=args.max_body_bytes, max_batch=args.max_batch)
    finally:
        sock.close()
    return 0


def _check_limits(args: argparse.Namespace, error: type[Exception]) -> None:
    if args.max_queue < 0:
        raise error(f"--max-queue {args.max_queue}: give 0 or more")
    if args.max_batch < 1:
        raise error(f"--max-batch {args.max_batch}: give 1 or more (1: one request at a time)")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise error(f"--timeout {args.timeout}: give a finite number of seconds > 0")
    if args.max_body_bytes <= 0:
        raise error(f"--max-body-bytes {args.max_body_bytes}: give a size > 0")


def _api_key(args: argparse.Namespace, error: type[Exception]) -> str | None:
    """--api-key, else $SPECULANT_API_KEY, else None (no key)."""
    from speculant.serve.app import check_api_key

    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif "SPECULANT_API_KEY" in os.environ:
        key, source = os.environ["SPECULANT_API_KEY"], "$SPECULANT_API_KEY"
    else:
        return None
    try:
        return check_api_key(key, source)
    except ValueError as exc:
        raise error(str(exc)) from None


def cmd_export(args: argparse.Namespace) -> int:
    from speculant.cli_settings import build_config
    from speculant.serve.export import export

    text, notes = export(build_config(args), args.to)
    for note in notes:
        print(f"speculant: note: {note}", file=sys.stderr)
    print(text)
    return 0
