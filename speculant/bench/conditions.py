"""The fixed conditions of a benchmark run, recorded once: versions, models, machine, threads.

Model folders are identified by a fingerprint of ``config.json`` plus every safetensors file's
name, size and JSON header (tensor names, dtypes, shapes, offsets), not the full weights:
fast on multi-GB checkpoints and still changes when any tensor does.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata as md
import os
import platform
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("speculant", "torch", "transformers", "tokenizers", "safetensors", "mlx", "mlx-lm", "numpy", "pydantic",
            "matplotlib", "rich")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
_MAX_HEADER = 100 * 1024 * 1024


def folder_fingerprint(path: str | Path) -> str | None:
    """sha256 over config.json and the safetensors headers and sizes; None if not a folder."""
    path = Path(path)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + b"\0")
        h.update(_safetensors_header(f))
    return h.hexdigest()


def _safetensors_header(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            return fh.read(min(n, _MAX_HEADER))
    except (OSError, struct.error):
        return b"unreadable"


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "system": platform.system(),
        "release": platform.release(),
        "machine": platform.machine(),
        "processor": _cpu_model() or platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
    }
    memory = _total_memory()
    if memory:
        info["memory_bytes"] = memory
    if hasattr(os, "sched_getaffinity"):
        info["cpus_available"] = len(os.sched_getaffinity(0))
    return info


def threads() -> dict[str, Any]:
    """Thread settings as they are now (call after the backends are loaded)."""
    out: dict[str, Any] = {name: os.environ[name] for name in THREAD_ENV if name in os.environ}
    torch = sys.modules.get("torch")  # only if a backend already imported it
    if torch is not None:
        out["torch_num_threads"] = torch.get_num_threads()
        out["torch_num_interop_threads"] = torch.get_num_interop_threads()
    return out


def git_revision() -> dict[str, Any] | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return {"commit": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def collect(models: dict[str, str | None], settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "packages": package_versions(),
        "git": git_revision(),
        "machine": machine(),
        "threads": threads(),
        "models": models,
        "settings": settings,
        "argv": sys.argv,
    }


def comparable(conditions: dict[str, Any]) -> dict[str, Any]:
    """The part that must match for a resumed run to continue the same measurement."""
    keep = ("packages", "machine", "models")
    return {k: conditions.get(k) for k in keep}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            run = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5)
            return run.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def _total_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
