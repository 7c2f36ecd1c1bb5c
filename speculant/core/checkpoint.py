"""Read checkpoint metadata without loading weights: safetensors headers, index and JSON files.

Every reader here turns a damaged file into one :class:`CheckpointError` (or :class:`ConfigError`
for JSON files) that names the file: a header that is cut off, nested too deeply for Python's JSON
parser, not a JSON object, or holding a tensor entry without a dtype, shape and byte range.
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Collection, Iterator

from speculant.core.errors import CheckpointError, ConfigError

MAX_HEADER_BYTES = 100_000_000
# What a weight of an unquantized checkpoint may be stored as: every loader casts these to the
# compute dtype. An integer dtype of the same width (a BF16 tensor relabelled I16) would be read as
# integers and cast, which decodes garbage without an error.
FLOAT_DTYPES = ("F32", "F16", "BF16")


def safetensors_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors"))


def read_header(file: str | Path) -> tuple[dict, int]:
    """The whole JSON header of a .safetensors file (``__metadata__`` included) and the offset
    where its tensor data starts; a CheckpointError naming the file when it cannot be read."""
    file = Path(file)
    try:
        with file.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (size,) = struct.unpack("<Q", head)
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"header length {size} is implausible")
            raw = fh.read(size)
        if len(raw) < size:
            raise ValueError(f"the header is cut off ({len(raw)} of {size} bytes)")
        header = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{file} is not a readable safetensors file: its header is nested too deeply "
                              "to be a tensor list") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} is not a readable safetensors file: its header is a JSON "
                              f"{type(header).__name__}, not an object mapping tensor names to entries")
    return header, 8 + size


def entry_problem(name: str, meta: object) -> str | None:
    """What is wrong with one tensor's header entry (None: a dtype string, a shape of
    non-negative integers and a ``data_offsets`` pair of integers)."""
    if not isinstance(meta, dict):
        return f"tensor {name} has a malformed header entry (not an object)"
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        return f"tensor {name} has a malformed header entry (no dtype)"
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        return f"tensor {name} has a malformed header entry (shape {shape!r})"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and o >= 0 for o in offsets)):
        return f"tensor {name} has a malformed header entry (data_offsets {offsets!r})"
    return None


def read_safetensors_header(file: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` from a .safetensors file's JSON header only."""
    header, _ = read_header(file)
    header.pop("__metadata__", None)
    tensors = {}
    for name, meta in header.items():
        problem = entry_problem(name, meta)
        if problem is not None:
            raise CheckpointError(f"{file}: {problem}")
        tensors[name] = (meta["dtype"], tuple(meta["shape"]))
    return tensors


def safetensors_metadata(file: str | Path) -> dict:
    """The ``__metadata__`` of a safetensors file (``{"format": "pt"}``...); empty when unreadable."""
    try:
        meta = read_header(file)[0].get("__metadata__")
    except CheckpointError:
        return {}
    return meta if isinstance(meta, dict) else {}


def tensor_inventory(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """All tensors of a folder's safetensors shards (names must be unique across shards). A
    CheckpointError names every unreadable shard, not only the first."""
    inventory: dict[str, tuple[str, tuple[int, ...]]] = {}
    errors = []
    for file in safetensors_files(folder):
        try:
            tensors = read_safetensors_header(file)
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        for name, meta in tensors.items():
            if name in inventory:
                errors.append(f"tensor {name!r} appears in more than one shard of {folder}")
            inventory[name] = meta
    if errors:
        raise CheckpointError("; ".join(errors))
    return inventory


def dtype_problem(file: Path, name: str, dtype: str, allowed: Collection[str] = FLOAT_DTYPES) -> str | None:
    if dtype in allowed:
        return None
    return f"{file.name}: tensor {name} is stored as {dtype}, expected one of {', '.join(allowed)} for an unquantized weight"


def float_dtype_problems(folder: str | Path, names: Collection[str] | None = None) -> list[str]:
    """A message per tensor (of ``names``; all when None) that is not stored as a float dtype,
    naming its file; readable headers are assumed (:func:`tensor_inventory` reports the others)."""
    problems = []
    for file in safetensors_files(folder):
        try:
            tensors = read_safetensors_header(file)
        except CheckpointError:
            continue
        for name, (dtype, _) in tensors.items():
            if names is None or name in names:
                problems.append(dtype_problem(file, name, dtype))
    return [p for p in problems if p is not None]


def require_float_tensors(folder: str | Path, names: Collection[str] | None = None) -> None:
    """A strict loader's check before it reads weights: every tensor (of ``names``) a float."""
    problems = float_dtype_problems(folder, names)
    if problems:
        raise CheckpointError(f"{folder}: " + "; ".join(problems))


def read_json_object(file: str | Path) -> dict:
    """A JSON file that must hold an object (config.json, tokenizer.json...); a ConfigError naming
    the file when it is missing, not UTF-8, not JSON or not an object."""
    file = Path(file)
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"{file} is not valid JSON: nested too deeply") from None
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{file} is not valid: it holds a JSON {type(value).__name__}, not an object")
    return value


@contextlib.contextmanager
def tokenizer_errors(folder: str | Path) -> Iterator[None]:
    """Loading a folder's tokenizer: any failure is the folder's (the tokenizers library raises
    plain Exceptions for a tokenizer.json it cannot parse), reported naming the folder."""
    try:
        yield
    except ImportError:
        raise  # a missing package (sentencepiece...) is the installation's, not the folder's
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"target.path: the tokenizer in {folder} cannot be loaded: {type(exc).__name__}: "
                              f"{first} (fix or re-download tokenizer.json / tokenizer_config.json)",
                              "target.path") from None


def compare_inventory(
    found: dict[str, tuple[str, tuple[int, ...]]],
    expected: dict[str, tuple[int, ...]],
    optional: set[str] = frozenset(),
) -> list[str]:
    """Human-readable differences: missing, unexpected and mis-shaped tensors."""
    problems = []
    for name, shape in expected.items():
        if name not in found:
            if name not in optional:
                problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif tuple(found[name][1]) != tuple(shape):
            problems.append(f"tensor {name} has shape {list(found[name][1])}, expected {list(shape)}")
    for name in found:
        if name not in expected:
            problems.append(f"unexpected tensor {name}")
    return problems
