"""The prefix cache's disk tier: entries evicted from memory are spilled to a directory, within a
byte budget of their own, and brought back when a request can use them.

One entry is three files named by a hash of its state key and tokens: ``NAME.safetensors`` (every
array it holds, written by the backend), ``NAME.structure.json`` (the rest of the snapshot's
structure, the arrays replaced by their names) and ``NAME.json`` (the state key, the tokens,
whether it can be cut, and the SHA-256 of the other two files). A file that was damaged or cut
short fails the checksum and is dropped with its entry: the request prefills those tokens instead.
The directory is rescanned at start, so later processes reuse it.

Never pickle: the structure is JSON, and the only objects it rebuilds are instances of cache
classes from an allow-list of modules (speculant's own, transformers' and mlx-lm's cache
modules), made with ``cls.__new__`` and given back their attributes, so no code runs on load. A
snapshot holding anything else is not spilled (it is dropped from memory instead).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Hashable, Sequence

from speculant.core.errors import ConfigError
from speculant.core.prefix_cache import PrefixEntry, PrefixStore

if TYPE_CHECKING:
    from speculant.core.config import PrefixCacheConfig

FORMAT = 2
STRUCTURE = ".structure.json"
ALLOWED_MODULES = ("speculant.", "transformers.cache_utils", "mlx_lm.models.cache")


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
        try:
            structure = json.dumps(_encode((entry.tokens, entry.snapshot, entry.features, entry.final_hidden),
                                           arrays, self.backend))
        except TypeError:  # a state this file format cannot hold: not spilled
            return False
        name = hashlib.sha256(repr((key, entry.tokens)).encode()).hexdigest()[:32]
        base = self.directory / name
        self.backend.save_arrays(str(base) + ".safetensors", arrays)
        _path(base, STRUCTURE).write_text(structure)
        size = sum(_size(base, suffix) for suffix in (".safetensors", STRUCTURE))
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
            tokens, snapshot, features, final = _decode(json.loads(_path(base, STRUCTURE).read_text()), arrays,
                                                        self.backend)
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
        records = (p for p in self.directory.glob("*.json") if not p.name.endswith(STRUCTURE))
        for meta in sorted(records, key=lambda p: p.stat().st_mtime):
            try:
                data = json.loads(meta.read_text())
                if data.get("format") != FORMAT:
                    continue
                key = _hashable(data["key"])
                self.records[meta.stem] = DiskRecord(meta.stem, key, tuple(data["tokens"]), bool(data["cuttable"]),
                                                     int(data["nbytes"]), str(data["checksum"]))
            except (OSError, ValueError, KeyError, TypeError):
                _remove(meta.with_suffix(""))


def _encode(value: Any, arrays: dict, backend: Any) -> Any:
    """JSON for ``value``: arrays by name (into ``arrays``), containers, scalars, and objects of
    allowed cache classes as their class name and attributes; anything else is a TypeError."""
    if backend.is_array(value):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {"array": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return {"list" if isinstance(value, list) else "tuple": [_encode(v, arrays, backend) for v in value]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, arrays, backend), _encode(v, arrays, backend)] for k, v in value.items()]}
    if (name := backend.value_name(value)) is not None:  # a dtype or device
        return {"named": name}
    cls = type(value)
    if cls.__module__.startswith(ALLOWED_MODULES) and hasattr(value, "__dict__"):
        return {"object": f"{cls.__module__}:{cls.__qualname__}", "attributes": _encode(vars(value), arrays, backend)}
    raise TypeError(f"cannot write a {cls.__module__}.{cls.__qualname__} to the disk tier")


def _decode(value: Any, arrays: dict, backend: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "array" in value:
        return arrays[value["array"]]
    if "list" in value or "tuple" in value:
        items = [_decode(v, arrays, backend) for v in value.get("list", value.get("tuple"))]
        return items if "list" in value else tuple(items)
    if "dict" in value:
        return {_decode(k, arrays, backend): _decode(v, arrays, backend) for k, v in value["dict"]}
    if "named" in value:
        return backend.named_value(value["named"])
    cls = _allowed_class(value["object"])
    obj = cls.__new__(cls)
    obj.__dict__.update(_decode(value["attributes"], arrays, backend))
    return obj


def _allowed_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(ALLOWED_MODULES):
        raise ValueError(f"{name}: not a cache class this file format may rebuild")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"{name} is not a class")
    return obj


def _path(base: Path, suffix: str) -> Path:
    return base.with_name(base.name + suffix)


def _checksum(base: Path) -> str:
    digest = hashlib.sha256()
    for suffix in (".safetensors", STRUCTURE):
        digest.update(_path(base, suffix).read_bytes())
    return digest.hexdigest()


def _size(base: Path, suffix: str) -> int:
    return _path(base, suffix).stat().st_size


def _remove(base: Path) -> None:
    for suffix in (".json", ".safetensors", STRUCTURE):
        _path(base, suffix).unlink(missing_ok=True)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value
