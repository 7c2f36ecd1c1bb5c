"""Fixtures for tests that run the official reference ``dflash`` 0.1.0 in its own venv.

``reference_venv`` skips with the reason when the venv is missing (or builds it first when
``SPECULANT_BUILD_REF_VENV=1``); ``ref_checkpoints`` builds tiny target/DFlash/DFlash2
checkpoints once per session, plain random and planted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .harness import ReferenceUnavailable, ensure_reference_venv


@pytest.fixture(scope="session")
def reference_venv() -> Path:
    """The reference venv's python; skips the test when the venv is unavailable."""
    try:
        return ensure_reference_venv()
    except ReferenceUnavailable as exc:
        pytest.skip(str(exc))


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
