"""Fixtures for tests that run the official reference ``dflash`` 0.1.0 in its own venv.

``reference_venv`` (tests/conftest.py) skips when the venv is missing; ``ref_checkpoints`` builds tiny target/DFlash/DFlash2
checkpoints once per session, plain random and planted.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ref_checkpoints(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """``{"random": {...}, "planted": {...}}``, each with target, dflash and dflash2 dirs."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from .make_tiny_checkpoints import build_all

    root = tmp_path_factory.mktemp("ref_ckpt")
    return {
        "random": build_all(root / "random", planted=False, seed=0),
        "planted": build_all(root / "planted", planted=True, seed=0),
    }
