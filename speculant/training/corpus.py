"""The training corpus: Python source files of the installed CPython standard library.

A file goes to the held-out split by a hash of its relative path, so the split is stable
across machines with the same Python version. The manifest records exactly what was used.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class CorpusFile:
    path: Path
    relative: str
    size: int


def stdlib_files(root: str | Path | None = None, include_tests: bool = False) -> list[CorpusFile]:
    """Every ``.py`` file under the standard library, site-packages excluded, sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = set(rel.parts[:-1])
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if not include_tests and parts & TEST_DIRS:
            continue
        files.append(CorpusFile(path, rel.as_posix(), path.stat().st_size))
    return files


def is_held_out(relative: str, fraction: float = 0.02) -> bool:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < fraction


def split(files: list[CorpusFile], held_out_fraction: float = 0.02) -> tuple[list[CorpusFile], list[CorpusFile]]:
    train = [f for f in files if not is_held_out(f.relative, held_out_fraction)]
    held = [f for f in files if is_held_out(f.relative, held_out_fraction)]
    return train, held


def read_text(file: CorpusFile) -> str | None:
    try:
        return file.path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def write_manifest(path: Path, train: list[CorpusFile], held: list[CorpusFile], extra: dict | None = None) -> None:
    manifest = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "stdlib": sysconfig.get_paths()["stdlib"],
        "train_files": [f.relative for f in train],
        "held_out_files": [f.relative for f in held],
        "train_bytes": sum(f.size for f in train),
        "held_out_bytes": sum(f.size for f in held),
        **(extra or {}),
    }
    path.write_text(json.dumps(manifest, indent=1))
