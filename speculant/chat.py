"""``speculant chat``: a multi-turn conversation in the terminal, streamed, on the prefix cache.

Each line typed is a user turn; the reply streams to stdout and a short stats line (time to first
token, prompt tokens taken from the prefix cache) goes to stderr. The conversation is an
``engine.session()``: with the tokenizer's chat template every turn resends the rendered
conversation, and the prefix cache restores what earlier turns left, so only the new turn is
prefilled. A target without a chat template continues the text: each line is appended to the
conversation's tokens (earlier lines and replies). ``/reset`` starts a new conversation,
``/exit`` or end of input (Ctrl-D) leaves; Ctrl-C ends a reply early (that turn is dropped) and,
at the prompt, leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from speculant.cli_settings import build_config, load_registry, warn


def add_parser(sub: Any, parents: list, add_override_flags: Callable) -> None:
    chat = sub.add_parser("chat", parents=parents, help="chat in the terminal, turn by turn (streamed, prefix-cached)")
    chat.add_argument("--config", metavar="FILE", help="engine config (.toml, .yaml, .json); flags override it")
    chat.add_argument("--system", metavar="TEXT", help="system message (with a chat template)")
    add_override_flags(chat)
    chat.set_defaults(func=cmd_chat)


def cmd_chat(args: argparse.Namespace) -> int:
    from speculant.api import load_engine

    engine = load_engine(build_config(args), registry=load_registry(args))
    for problem in engine.report.warnings if engine.report else []:
        warn(str(problem))
    templated = bool(getattr(engine.tokenizer, "chat_template", None))
    if not templated:
        warn("the target's tokenizer has no chat template: each line continues the text")
    session = engine.session(args.system if templated else None)
    interactive = sys.stdin.isatty()
    while True:
        line = _read(interactive)
        if line is None or line.strip() == "/exit":
            return 0
        if line.strip() == "/reset":
            session = engine.session(args.system if templated else None)
            continue
        if line.strip():
            _turn(engine, session, line, templated)


def _read(interactive: bool) -> str | None:
    """The next line typed (None at the end of input or Ctrl-C at the prompt)."""
    try:
        return input("> " if interactive else "")
    except (EOFError, KeyboardInterrupt):
        return None


def _turn(engine: Any, session: Any, line: str, templated: bool) -> None:
    """Stream one reply; Ctrl-C ends it early (the turn is then not kept)."""
    if templated:
        chunks = session.stream(line)
    else:  # the line's tokens after the conversation's
        chunks = session.extend_stream(engine.tokenizer.encode(line + "\n", add_special_tokens=not session.token_ids))
    last = None
    try:
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
    except KeyboardInterrupt:
        chunks.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and last.stats is not None:
        print(_stats_line(last.stats), file=sys.stderr)


def _stats_line(stats: Any) -> str:
    return (f"[{stats.new_tokens} tokens, TTFT {stats.ttft_s * 1000:.0f} ms, "
            f"{stats.cached_tokens} of {stats.prompt_tokens} prompt tokens from the prefix cache]")
