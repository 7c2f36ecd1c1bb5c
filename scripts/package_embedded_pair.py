"""Copy a finished ``build_embedded_pair.sh`` work folder into the package, weights in bfloat16.

    python scripts/package_embedded_pair.py WORK_DIR speculant/embedded/pair [KIND=FOLDER ...]
    python scripts/package_embedded_pair.py --bf16 MODEL_DIR OUT_DIR

``KIND=FOLDER`` (e.g. ``dflash=dflash-v2``) packages ``WORK_DIR/FOLDER`` as the shipped ``KIND``
drafter (default: the folder named after the kind). ``--bf16`` copies one model folder with its
weights rounded to bfloat16, exactly as they are shipped (later training stages start from these).

Writes MANIFEST.json: the corpus (Python version, file counts, token counts; the file lists go
to corpus.json), each model's training settings and tokens seen, and every file's size and sha256.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LIMIT_BYTES = 40 * 1024 * 1024
TARGET_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "training.json")
DRAFTER_FILES = ("config.json", "training.json")


def to_bf16(src: Path, dst: Path) -> None:
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in load_file(str(src)).items()}
    save_file(tensors, str(dst), metadata={"format": "pt"})


def copy_model(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    to_bf16(src / "model.safetensors", dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def held_out_tokens(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    from speculant.training.command import corpus_texts

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return sum(len(ids) for ids in tokenizer(corpus_texts(held_out=True), add_special_tokens=False)["input_ids"])


def training_data(work: Path, folders: dict[str, str]) -> dict:
    """The target-generated sequences each shipped drafter was (last) trained on, from its training.json."""
    data = {}
    for kind, folder in folders.items():
        info = json.loads((work / folder / "training.json").read_text())
        entry = data.setdefault(info.get("sequences_file", "sequences.npy"), {
            "sequences": info["sequences"], "sequence_length": info["sequence_length"],
            "tokens": info["sequences"] * info["sequence_length"], "drafters": [],
            "made_by": info.get("sequences_made_by", "corpus prompts continued greedily by the target")})
        entry["drafters"].append(kind)
    return data


def main(work: Path, out: Path, folders: dict[str, str]) -> None:
    if out.exists():
        shutil.rmtree(out)
    copy_model(work / "target" / "model", out / "target", TARGET_FILES)
    for kind, folder in folders.items():
        copy_model(work / folder, out / kind, DRAFTER_FILES)
    corpus = json.loads((work / "tokenizer" / "corpus.json").read_text())
    shutil.copy2(work / "tokenizer" / "corpus.json", out / "corpus.json")
    files = {p.relative_to(out).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(out.rglob("*")) if p.is_file()}
    total = sum(f["bytes"] for f in files.values())
    if total > LIMIT_BYTES:
        raise SystemExit(f"the pair is {total / 2**20:.1f} MiB, over the {LIMIT_BYTES / 2**20:.0f} MiB limit")
    manifest = {
        "recipe": "bash scripts/build_embedded_pair.sh (seed 0); see README 'The shipped model pair'",
        "corpus": {
            "source": f"CPython {corpus['python']} standard library .py files, tests excluded",
            "python": corpus["python"], "implementation": corpus["implementation"],
            "train_files": len(corpus["train_files"]), "held_out_files": len(corpus["held_out_files"]),
            "train_bytes": corpus["train_bytes"], "held_out_bytes": corpus["held_out_bytes"],
            "train_tokens": int(len(np.load(work / "target" / "corpus_tokens.npy"))),
            "held_out_tokens": held_out_tokens(work / "tokenizer"),
            "file_lists": "corpus.json",
        },
        "drafter_training_data": training_data(work, folders),
        "training": {name: json.loads((out / name / "training.json").read_text())
                     for name in ("target", "dflash", "dflash2", "mtp")},
        "weights_dtype": "bfloat16",
        "total_bytes": total,
        "files": files,
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"packaged {len(files)} files, {total / 2**20:.1f} MiB, into {out}")


if __name__ == "__main__":
    if sys.argv[1] == "--bf16":
        src, dst = Path(sys.argv[2]), Path(sys.argv[3])
        copy_model(src, dst, TARGET_FILES + DRAFTER_FILES)
    else:
        folders = {"dflash": "dflash", "dflash2": "dflash2", "mtp": "mtp"}
        folders.update(arg.split("=", 1) for arg in sys.argv[3:])
        main(Path(sys.argv[1]), Path(sys.argv[2]), folders)
