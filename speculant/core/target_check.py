"""Checks of a target folder's safetensors files from their headers alone (``speculant validate``).

The exact list of tensors a target needs is known only to the backend that builds the model
(``strict`` loading there names every missing, unexpected or mis-shaped tensor). Without
building it, the headers still show a damaged checkpoint: a file shorter than its header says
(truncated), a tensor whose byte range does not fit its dtype and shape, a shard an index names
that is not there, a decoder layer lacking a tensor its siblings of the same kind have, one
layer whose tensor's shape differs from all its siblings', and, in checkpoints named the Llama
way (``...layers.N...``), a missing or mis-shaped input embedding, final norm or untied LM head.
Every text-model tensor must be a float (F32 / F16 / BF16) unless its module is quantized, and
the tokenizer's JSON files must parse. The strict loaders of both backends run the file-level
checks again (:func:`check_target_files`) before they read weights.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from speculant.core.checkpoint import dtype_problem, entry_problem, read_header, read_json_object
from speculant.core.errors import CheckpointError, ConfigError
from speculant.core.types import TargetInfo

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "E8M0": 1}
_LAYER = re.compile(r"^(?P<prefix>(?:.*\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
_SKIPPED_PREFIX_WORDS = ("vision", "visual", "audio", "mtp")  # not the text decoder the target runs
_QUANT_SUFFIXES = (".scales", ".biases")
# The README's table of target families (named in messages about an unknown model_type).
TESTED_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma3_text",
                   "mistral", "gpt_oss", "muse_glimmer")


def file_problems(file: Path) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[str]]:
    """``({tensor: (dtype, shape)}, problems)`` of one safetensors file: readable header, every
    tensor's byte range matching its dtype and shape, and all of the data present."""
    try:
        header, start = read_header(file)
    except CheckpointError as exc:
        return {}, [str(exc).replace(str(file), file.name, 1)]
    header.pop("__metadata__", None)
    problems, tensors, end = [], {}, 0
    for name, meta in header.items():
        malformed = entry_problem(name, meta)
        if malformed:
            problems.append(f"{file.name}: {malformed}")
            continue
        dtype, shape, (first, last) = meta["dtype"], tuple(meta["shape"]), meta["data_offsets"]
        tensors[name] = (dtype, shape)
        end = max(end, last)
        width = DTYPE_BYTES.get(dtype)
        if width is not None and last - first != width * math.prod(shape):
            problems.append(f"{file.name}: tensor {name} ({dtype} {list(shape)}) should take "
                            f"{width * math.prod(shape)} bytes but its header gives {last - first}")
    held = file.stat().st_size - start
    if held < end:
        problems.append(f"{file.name} is truncated: its header describes {end} bytes of tensor data but the file "
                        f"holds {held} (an interrupted download or copy?)")
    return tensors, problems


def index_problems(folder: Path) -> list[str]:
    """A sharded checkpoint's index must name shards that exist."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return []
    try:
        weight_map = read_json_object(index).get("weight_map", {})
    except ConfigError as exc:
        return [str(exc).replace(str(index), index.name, 1)]
    if not (isinstance(weight_map, dict) and all(isinstance(shard, str) for shard in weight_map.values())):
        return [f"{index.name} is not valid: its weight_map is not an object of shard file names"]
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


def _outside_text_model(name: str) -> bool:
    """Vision / audio towers and MTP layers: tensors the target's text decoder never reads."""
    return any(part.startswith(_SKIPPED_PREFIX_WORDS) for part in name.split(".")[:3])


def _quantized_parts(names) -> set[str]:
    """Tensors of quantized modules: a module (name less its last part) holding anything but a
    plain ``weight`` / ``bias`` (mlx-lm's ``scales`` / ``biases``, FP8 ``weight_scale_inv``, GPTQ
    ``qweight``, MXFP4 ``*_blocks``, bitsandbytes' ``weight.absmax``...), and a tensor that has
    sub-entries of its own. Their packed dtypes are the quantization's business."""
    modules: dict[str, list[str]] = defaultdict(list)
    for name in names:
        module, _, part = name.rpartition(".")
        modules[module].append(part)
    quantized = {m for m, parts in modules.items() if any(p not in ("weight", "bias") for p in parts)}
    return {n for n in names if n.rpartition(".")[0] in quantized or n in modules}


def dtype_problems(dtypes: dict[str, tuple[Path, str]], info: TargetInfo) -> list[str]:
    """Every text-model tensor stored with a dtype other than F32 / F16 / BF16, naming its file.
    In a quantized checkpoint (config.json ``quantization`` / ``quantization_config``) the tensors
    of quantized modules are left to the quantization's loader; norms and the like stay checked."""
    exempt = _quantized_parts(dtypes) if info.quantization else set()
    problems = []
    for name, (file, dtype) in sorted(dtypes.items()):
        if name not in exempt and not _outside_text_model(name):
            problems.append(dtype_problem(file, name, dtype))
    return [p for p in problems if p is not None]


CHECKED_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "generation_config.json")


def json_file_problems(folder: str | Path) -> list[str]:
    """The tokenizer's JSON files and generation_config.json, where present, must parse (the
    tokenizer loader would fail naming none; a bad generation_config.json would drop EOS ids)."""
    problems = []
    for name in CHECKED_JSON_FILES:
        file = Path(folder) / name
        if file.exists():
            try:
                read_json_object(file)
            except ConfigError as exc:
                problems.append(str(exc).replace(str(file), name, 1))
    return problems


def header_problems(folder: str | Path) -> tuple[dict[str, tuple[Path, str, tuple[int, ...]]], list[str]]:
    """``({tensor: (file, dtype, shape)}, problems)`` over every shard's header."""
    tensors: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    problems = index_problems(Path(folder))
    for file in sorted(Path(folder).glob("*.safetensors")):
        found, bad = file_problems(file)
        problems += bad
        for name, (dtype, shape) in found.items():
            if name in tensors:
                problems.append(f"tensor {name} appears in more than one shard")
            tensors[name] = (file, dtype, shape)
    return tensors, problems


def target_tensor_problems(folder: str | Path, info: TargetInfo | None) -> list[str]:
    """Everything the headers show wrong with a target folder's safetensors (empty when none);
    without ``info`` (an unreadable config.json) only what each file shows on its own."""
    tensors, problems = header_problems(folder)
    if info is None:
        return problems
    shapes = {name: shape for name, (_, _, shape) in tensors.items()}
    problems += dtype_problems({name: (file, dtype) for name, (file, dtype, _) in tensors.items()}, info)
    return problems + layer_problems(shapes, info) + outer_problems(shapes, info)


def check_target_files(folder: str | Path, info: TargetInfo) -> None:
    """What a strict target loader checks before reading weights: readable, complete headers and
    float tensors (where the checkpoint is not quantized); a CheckpointError names them all."""
    tensors, problems = header_problems(folder)
    problems += dtype_problems({name: (file, dtype) for name, (file, dtype, _) in tensors.items()}, info)
    if problems:
        raise CheckpointError(f"target.path: checkpoint {folder} is damaged: {'; '.join(problems)} "
                              "(download or copy the checkpoint again)", "target.path")
