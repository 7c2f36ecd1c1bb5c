"""``speculant train export``: a trained draft as shipped in a package: config.json, bfloat16
model.safetensors and a manifest.json (training command and settings, data provenance and
licences, the source commit, the measured acceptance length)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def source_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def export_draft(draft_dir: str | Path, out_dir: str | Path, evaluation: str | Path | None = None,
                 command: list[str] | None = None) -> Path:
    """Write ``out_dir`` from a trained draft folder (with training.json) and, when given, the
    JSON ``speculant train evaluate`` printed for it."""
    import torch
    from safetensors.torch import load_file, save_file

    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    for name in ("config.json", "model.safetensors", "training.json"):
        if not (draft_dir / name).is_file():
            raise SystemExit(f"--draft {draft_dir}: no {name} (a finished `speculant train dflash|dflash2` folder has one)")
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((draft_dir / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    training = json.loads((draft_dir / "training.json").read_text())
    manifest = {
        "drafter": config.get("architectures", ["?"])[0],
        "exported_by": " ".join(command or ["speculant", *sys.argv[1:]]),
        "source_commit": source_commit(),
        "training": training,
        "data": training.get("data"),
        "evaluation": json.loads(Path(evaluation).read_text()) if evaluation else None,
        "parameters": int(sum(v.numel() for v in state.values())),
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return out_dir
