"""Checks of a target folder's safetensors files from their headers alone (``speculant validate``).

The exact list of tensors a target needs is known only to the backend that builds the model
(``strict`` loading there names every missing, unexpected or mis-shaped tensor). Without
building it, the headers still show a damaged checkpoint: a file shorter than its header says
(truncated), a tensor whose byte range does not fit its dtype and shape, a shard an index names
that is not there, a decoder layer lacking a tensor its siblings of the same kind have, one
layer whose tensor's shape differs from all its siblings', and, in checkpoints named the Llama
way (``...layers.N...``), a missing or mis-shaped input embedding, final norm or untied LM head.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import Counter, defaultdict
from pathlib import Path

from speculant.core.types import TargetInfo

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "E8M0": 1}
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
_SKIPPED_PREFIX_WORDS = ("vision", "visual", "audio", "mtp")  # not the text decoder the target runs
_QUANT_SUFFIXES = (".scales", ".biases")


def read_header(file: Path) -> tuple[dict, int]:
    """The raw header ``{name: {dtype, shape, data_offsets}}`` and where the data starts."""
    with file.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (size,) = struct.unpack("<Q", head)
        if size > 100_000_000:
            raise ValueError(f"header length {size} is implausible")
        raw = fh.read(size)
    if len(raw) < size:
        raise ValueError(f"the header is cut off ({len(raw)} of {size} bytes)")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + size


def file_problems(file: Path) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """``({tensor: shape}, problems)`` of one safetensors file: readable header, every tensor's
    byte range matching its dtype and shape, and all of the data present."""
    try:
        header, start = read_header(file)
    except (OSError, ValueError) as exc:
        return {}, [f"{file.name} is not a readable safetensors file: {exc}"]
    problems, shapes, end = [], {}, 0
    for name, meta in header.items():
        try:
            dtype, shape, (first, last) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            problems.append(f"{file.name}: tensor {name} has a malformed header entry")
            continue
        shapes[name] = shape
        end = max(end, int(last))
        width = DTYPE_BYTES.get(dtype)
        if width is not None and int(last) - int(first) != width * math.prod(shape):
            problems.append(f"{file.name}: tensor {name} ({dtype} {list(shape)}) should take "
                            f"{width * math.prod(shape)} bytes but its header gives {int(last) - int(first)}")
    held = file.stat().st_size - start
    if held < end:
        problems.append(f"{file.name} is truncated: its header describes {end} bytes of tensor data but the file "
                        f"holds {held} (an interrupted download or copy?)")
    return shapes, problems


def index_problems(folder: Path) -> list[str]:
    """A sharded checkpoint's index must name shards that exist."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    except (OSError, ValueError, AttributeError) as exc:
        return [f"{index.name} is not readable: {exc}"]
    missing = sorted({shard for shard in weight_map.values() if not (folder / shard).is_file()})
    return [f"{index.name} names shard {shard}, which is not in the folder" for shard in missing]


def layer_problems(shapes: dict[str, tuple[int, ...]], info: TargetInfo) -> list[str]:
    """Decoder layers of one kind (``layer_types``) should hold the same tensors: a layer whose
    tensor set is a strict subset of a sibling's lacks what the sibling has; a tensor whose shape
    differs in one layer from all (at least three) siblings is mis-shaped. Layers of different
    designs within one kind (dense and mixture-of-experts MLPs) are never subsets of each other."""
    groups: dict[tuple[str, str], dict[int, dict[str, tuple[int, ...]]]] = defaultdict(lambda: defaultdict(dict))
    quantized = bool(info.quantization)
    for name, shape in shapes.items():
        match = _LAYER.match(name)
        if match is None or any(word in match["prefix"] for word in _SKIPPED_PREFIX_WORDS):
            continue
        index, rest = int(match["index"]), match["rest"]
        if index >= info.num_hidden_layers or (quantized and rest.endswith(_QUANT_SUFFIXES)):
            continue
        kind = info.layer_types[index] if index < len(info.layer_types) else "layer"
        groups[(match["prefix"], kind)][index][rest] = shape
    problems = []
    for (prefix, kind), layers in groups.items():
        problems += _subset_problems(prefix, layers)
        if not quantized:
            problems += _shape_problems(prefix, layers)
    return problems


def _subset_problems(prefix: str, layers: dict[int, dict]) -> list[str]:
    """A tensor only one layer has, beside at least two siblings without it, is unexpected there;
    otherwise a layer lacking what a fuller sibling has is missing it."""
    holders: Counter = Counter(rest for tensors in layers.values() for rest in tensors)
    problems: dict[str, str] = {}  # tensor name -> message, each tensor once
    for index, tensors in sorted(layers.items()):
        names = set(tensors)
        for other in sorted(o for o, theirs in layers.items() if names < set(theirs)):
            for rest in sorted(set(layers[other]) - names):
                if holders[rest] == 1 and len(layers) >= 3:
                    problems.setdefault(f"{prefix}.{other}.{rest}", f"unexpected tensor {prefix}.{other}.{rest} "
                                        "(no other layer of its kind has it)")
                else:
                    problems.setdefault(f"{prefix}.{index}.{rest}", f"missing tensor {prefix}.{index}.{rest} (layer "
                                        f"{other} of the same kind has {prefix}.{other}.{rest})")
    return list(problems.values())


def _shape_problems(prefix: str, layers: dict[int, dict]) -> list[str]:
    problems = []
    by_suffix: dict[str, dict[int, tuple[int, ...]]] = defaultdict(dict)
    for index, tensors in layers.items():
        for rest, shape in tensors.items():
            by_suffix[rest][index] = shape
    for rest, per_layer in sorted(by_suffix.items()):
        if len(per_layer) < 4:
            continue
        counts = Counter(per_layer.values())
        (common, n), *others = counts.most_common()
        if len(others) == 1 and others[0][1] == 1 and n == len(per_layer) - 1:
            odd = next(i for i, s in per_layer.items() if s != common)
            problems.append(f"tensor {prefix}.{odd}.{rest} has shape {list(per_layer[odd])} but the other layers "
                            f"of its kind have {list(common)}")
    return problems


def outer_problems(shapes: dict[str, tuple[int, ...]], info: TargetInfo) -> list[str]:
    """The text decoder's tensors outside its layers: ``embed_tokens`` [vocab, hidden], the final
    ``norm`` [hidden] and, unless tied, ``lm_head`` [vocab, hidden]. Only for unquantized
    checkpoints named the Llama way (packed quantized shapes differ; other namings are unknown)."""
    text = {n: s for n, s in shapes.items() if not any(w in n.split(".")[0:3] for w in _SKIPPED_PREFIX_WORDS)
            and not any(n.startswith(w) for w in _SKIPPED_PREFIX_WORDS)}
    layered = [n for n in text if _LAYER.match(n)]
    if info.quantization or not layered:
        return []
    decoder = layered[0][: layered[0].index("layers.")]  # "model." or "model.language_model."
    vocab_rows, hidden = (info.vocab_size, info.hidden_size), (info.hidden_size,)
    wanted = {f"{decoder}embed_tokens.weight": vocab_rows, f"{decoder}norm.weight": hidden}
    if not info.tie_word_embeddings:
        wanted["lm_head.weight"] = vocab_rows
    problems = []
    for name, shape in wanted.items():
        if name not in text:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
        elif text[name] != shape:
            problems.append(f"tensor {name} has shape {list(text[name])}, expected {list(shape)}")
    return problems


def target_tensor_problems(folder: str | Path, info: TargetInfo) -> list[str]:
    """Everything the headers show wrong with a target folder's safetensors (empty when none)."""
    folder = Path(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    problems = index_problems(folder)
    for file in sorted(folder.glob("*.safetensors")):
        found, bad = file_problems(file)
        problems += bad
        for name in found:
            if name in shapes:
                problems.append(f"tensor {name} appears in more than one shard")
        shapes.update(found)
    return problems + layer_problems(shapes, info) + outer_problems(shapes, info)
