"""``speculant serve`` and ``speculant export``: parsers and commands (no array library imported here)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from speculant.serve import DEFAULT_HOST, DEFAULT_PORT


def add_parsers(sub: Any, parents: list, add_override_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    serve = sub.add_parser("serve", parents=parents, help="serve an OpenAI-compatible HTTP API (needs [serve])")
    serve.add_argument("--config", metavar="FILE", help="engine config (.toml, .yaml, .json); default: the shipped pair")
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                            "(default: $SPECULANT_API_KEY)")
    serve.add_argument("--model-name", default="speculant", metavar="NAME", help="the model id clients pass")
    serve.add_argument("--max-queue", type=int, default=64, metavar="N",
                       help="requests that may wait for the engine; more get 429 (default 64)")
    serve.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per-request limit in seconds")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="request body limit")
    add_override_flags(serve)
    serve.set_defaults(func=cmd_serve)

    export = sub.add_parser("export", parents=parents,
                            help="print the launch command of vLLM, SGLang, llama.cpp or oMLX for the same pairing")
    export.add_argument("--to", required=True, choices=["vllm", "sglang", "llama.cpp", "omlx"], help="the engine")
    export.add_argument("--config", metavar="FILE", help="engine config; default: the shipped pair")
    add_override_flags(export)
    export.set_defaults(func=cmd_export)


def cmd_serve(args: argparse.Namespace) -> int:
    from speculant.cli_settings import UsageError, build_config, load_registry, warn
    from speculant.api import load_engine

    try:
        from speculant.serve import run
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"speculant serve needs the [serve] extra: pip install 'speculant[serve]' ({exc})") from None
    if args.max_queue < 0 or args.timeout <= 0 or args.max_body_bytes <= 0:
        raise UsageError("--max-queue must be >= 0, --timeout and --max-body-bytes > 0")
    engine = load_engine(build_config(args), registry=load_registry(args))
    for problem in engine.report.warnings if engine.report else []:
        warn(str(problem))
    api_key = args.api_key or os.environ.get("SPECULANT_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        warn(f"serving on {args.host} without --api-key: anyone who can reach this port can use the model")
    print(f"speculant: serving {args.model_name!r} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    run(engine, host=args.host, port=args.port, model_name=args.model_name, api_key=api_key,
        max_queue=args.max_queue, timeout=args.timeout, max_body_bytes=args.max_body_bytes)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from speculant.cli_settings import build_config
    from speculant.serve.export import export

    text, notes = export(build_config(args), args.to)
    for note in notes:
        print(f"speculant: note: {note}", file=sys.stderr)
    print(text)
    return 0
