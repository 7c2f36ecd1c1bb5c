"""The prefix cache's disk tier: entries evicted from memory are spilled to a directory, within a
byte budget of their own, and brought back when a request can use them.

One entry is three files named by a hash of its state key and tokens: ``NAME.safetensors`` (every
array it holds, written by the backend), ``NAME.pickle`` (the rest of the snapshot's structure,
the arrays replaced by their names) and ``NAME.json`` (the state key, the tokens, whether it can
be cut, and the SHA-256 of the other two files). A file that was damaged or cut short fails the
checksum and is dropped with its entry: the request prefills those tokens instead. The directory
is rescanned at start, so later processes reuse it. Its pickles are loaded: use a directory only
speculant (and you) write to.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Sequence

from speculant.core.errors import ConfigError
from speculant.core.prefix_cache import PrefixEntry, PrefixStore

if TYPE_CHECKING:
    from speculant.core.config import PrefixCacheConfig

FORMAT = 1


def prefix_store(config: "PrefixCacheConfig", backend: Any) -> PrefixStore:
    """The engine's store: ``max_bytes`` in memory, spilling to ``disk_dir`` when it is set."""
    if config.disk_dir is None or config.max_bytes == 0:
        return PrefixStore(config.max_bytes)
    if not backend.writes_arrays:
        raise ConfigError(f"prefix_cache.disk_dir: the {backend.name} backend cannot write arrays to disk; "
                          "leave disk_dir unset")
    return PrefixStore(config.max_bytes, DiskTier(config.disk_dir, config.disk_max_bytes, backend))


@dataclass
class DiskRecord:
    name: str
    key: Hashable
    tokens: tuple[int, ...]
    cuttable: bool
    nbytes: int
    checksum: str

    def usable(self, prompt: Sequence[int]) -> int:
        limit = min(len(prompt) - 1, len(self.tokens))
        shared = next((i for i in range(limit) if self.tokens[i] != prompt[i]), limit)
        return shared if self.cuttable or shared == len(self.tokens) else 0


class DiskTier:
    """Spilled entries in ``directory``, at most ``max_bytes`` of files, least recently used out first."""

    def __init__(self, directory: str | Path, max_bytes: int, backend: Any) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backend = backend
        self.records: dict[str, DiskRecord] = {}  # in least-recently-used order
        self.dropped = 0  # entries whose files failed the checksum
        self._lock = threading.Lock()
        self._scan()

    @property
    def bytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def put(self, key: Hashable, entry: PrefixEntry) -> bool:
        arrays: dict[str, Any] = {}
        structure = _dumps((entry.tokens, entry.snapshot, entry.features, entry.final_hidden), arrays, self.backend)
        name = hashlib.sha256(repr((key, entry.tokens)).encode()).hexdigest()[:32]
        base = self.directory / name
        self.backend.save_arrays(str(base) + ".safetensors", arrays)
        (base.with_suffix(".pickle")).write_bytes(structure)
        size = sum(_size(base, suffix) for suffix in (".safetensors", ".pickle"))
        if size > self.max_bytes:
            _remove(base)
            return False
        record = DiskRecord(name, key, entry.tokens, entry.snapshot.cuttable, size, _checksum(base))
        base.with_suffix(".json").write_text(json.dumps({"format": FORMAT, "key": _jsonable(key),
                                                          "tokens": list(entry.tokens), "cuttable": record.cuttable,
                                                          "nbytes": size, "checksum": record.checksum}))
        with self._lock:
            self.records.pop(name, None)
            self.records[name] = record
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self.records)))
        return True

    def find(self, key: Hashable, prompt: Sequence[int]) -> tuple[DiskRecord, int] | None:
        with self._lock:
            best = max(((r, r.usable(prompt)) for r in self.records.values() if r.key == key),
                       key=lambda pair: pair[1], default=None)
        return best if best is not None and best[1] > 0 else None

    def load(self, record: DiskRecord) -> PrefixEntry | None:
        """The entry, or None (its files dropped) when they fail the checksum or cannot be read."""
        base = self.directory / record.name
        try:
            if _checksum(base) != record.checksum:
                raise ValueError("checksum mismatch")
            arrays = self.backend.load_arrays(str(base) + ".safetensors")
            tokens, snapshot, features, final = _loads(base.with_suffix(".pickle").read_bytes(), arrays)
        except Exception:  # noqa: BLE001  damaged, cut short or gone: recompute those tokens
            with self._lock:
                self._drop(record.name)
                self.dropped += 1
            return None
        with self._lock:
            self._drop(record.name)  # back in memory now; spilled again if evicted again
        return PrefixEntry(tuple(tokens), snapshot, features, final)

    def clear(self) -> None:
        with self._lock:
            for name in list(self.records):
                self._drop(name)

    def _drop(self, name: str) -> None:
        self.records.pop(name, None)
        _remove(self.directory / name)

    def _scan(self) -> None:
        """Take in the entries an earlier process left (their checksums are checked on load)."""
        for meta in sorted(self.directory.glob("*.json"), key=lambda p: p.stat().st_mtime):
            try:
                data = json.loads(meta.read_text())
                if data.get("format") != FORMAT:
                    continue
                key = _hashable(data["key"])
                self.records[meta.stem] = DiskRecord(meta.stem, key, tuple(data["tokens"]), bool(data["cuttable"]),
                                                     int(data["nbytes"]), str(data["checksum"]))
            except (OSError, ValueError, KeyError, TypeError):
                _remove(meta.with_suffix(""))


class _Pickler(pickle.Pickler):
    def __init__(self, file, arrays: dict, backend: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays, self.backend = arrays, backend

    def persistent_id(self, obj):
        if self.backend.is_array(obj):
            name = f"a{len(self.arrays)}"
            self.arrays[name] = obj
            return name
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, arrays: dict) -> None:
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid):
        return self.arrays[pid]


def _dumps(value: Any, arrays: dict, backend: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, arrays, backend).dump(value)
    return buffer.getvalue()


def _loads(data: bytes, arrays: dict) -> Any:
    return _Unpickler(io.BytesIO(data), arrays).load()


def _checksum(base: Path) -> str:
    digest = hashlib.sha256()
    for suffix in (".safetensors", ".pickle"):
        digest.update(base.with_suffix(suffix).read_bytes())
    return digest.hexdigest()


def _size(base: Path, suffix: str) -> int:
    return base.with_suffix(suffix).stat().st_size


def _remove(base: Path) -> None:
    for suffix in (".json", ".safetensors", ".pickle"):
        base.with_suffix(suffix).unlink(missing_ok=True)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
