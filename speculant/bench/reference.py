"""Extra columns with ``--reference``: the official ``dflash`` loop, and transformers' DFlash.

The reference loop runs out of process through the repository's reference harness
(``tests/reference/harness.py``, a source checkout), in the reference venv made by
``scripts/make_reference_venv.sh`` (dflash 0.1.0 needs transformers 5.15; speculant runs on a
newer one). All prompts of a cell go to one reference process (``run_reference_batch``), each
once, with the cell's block size and sampling settings. The column reports the reference's
decode speed and acceptance length, the ratio of speculant's speculative decode speed to it,
and whether its greedy output equals speculant's plain output token for token. Loading time
is excluded on both sides, but the reference runs in another process and without repeats, so
read its ratio as a sanity check, not a precise figure.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
from pathlib import Path
from typing import Any, Callable

from speculant.bench.matrix import Cell

REFERENCE_DRAFTERS = ("dflash", "dflash2")
REFERENCE_VERIFIERS = ("auto", "greedy", "speculative_sampling")
_ROOT = Path(__file__).resolve().parents[2]
HARNESS = _ROOT / "tests" / "reference" / "harness.py"

Runner = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def reference_applicability(cell: Cell) -> str | None:
    """Why the reference loop cannot run this cell, or None when it can."""
    if cell.is_plain:
        return "plain cell"
    if cell.drafter not in REFERENCE_DRAFTERS:
        return f"the reference package has no {cell.drafter} drafter"
    if cell.backend.kind not in ("torch", "mlx"):
        return f"the reference has no {cell.backend.kind} backend"
    if cell.backend.kind == "torch" and cell.backend.device not in ("cpu", "auto"):
        return "the reference harness runs the torch loop on CPU only"
    if cell.quantization != "off":
        return "the reference harness does not quantize drafts"
    if cell.verifier not in REFERENCE_VERIFIERS:
        return f"the reference has no {cell.verifier} verifier"
    return None


def find_reference_runner(harness: Path = HARNESS) -> tuple[Runner | None, str]:
    """(runner, description) or (None, why not). The runner takes a list of jobs (keyword
    arguments of the harness's ``run_reference``: backend, target_dir, draft_dir, prompt_ids,
    max_new_tokens, block_size, temperature, top_p, top_k, seed, stop_token_ids) and returns
    one dict per job with ``tokens``, ``acceptance_lengths``, ``decode_s``, ``ttft_s``, ``wall_s``."""
    if not harness.is_file():
        return None, f"the reference harness {harness} is not available (it ships with a source checkout)"
    spec = importlib.util.spec_from_file_location("_speculant_reference_harness", harness)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # reported in the column, never fatal
        return None, f"cannot import the reference harness {harness}: {type(exc).__name__}: {exc}"
    problem = getattr(module, "reference_venv_problem", lambda: None)()
    if problem:
        return None, problem
    batch = getattr(module, "run_reference_batch", None)
    if callable(batch):
        return batch, f"dflash reference loop via {harness.name} (venv {getattr(module, 'reference_python', str)()})"
    single = getattr(module, "run_reference", None)
    if not callable(single):
        return None, f"{harness} has no run_reference"
    accepted = set(inspect.signature(single).parameters)
    keyword = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(single).parameters.values())

    def run_each(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [single(**{k: v for k, v in job.items() if keyword or k in accepted}) for job in jobs]

    return run_each, f"dflash reference loop via {harness.name}"


def transformers_status(draft_path: str | None) -> tuple[bool, str]:
    """Whether transformers' own DFlash assisted generation can run this draft, and why not."""
    if importlib.util.find_spec("transformers") is None:
        return False, "transformers is not installed"
    import importlib.metadata as md

    version = md.version("transformers")
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES as names
    if not hasattr(transformers.GenerationConfig(), "speculation_type"):
        return False, f"transformers {version} has no speculation_type in generate()"
    if draft_path is None:
        return False, "no draft checkpoint"
    try:
        raw = json.loads((Path(draft_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return False, f"cannot read the draft config: {exc}"
    model_type = raw.get("model_type")
    cls_name = names.get(model_type)
    cls = getattr(transformers, cls_name, None) if cls_name else None
    if cls is not None and "noise_embeds" in inspect.signature(cls.forward).parameters:
        return True, (f"transformers {version} can load this draft ({cls_name}) for speculation_type='dflash', "
                      "but the bench has no runner for that column yet")
    dflash_types = [t for t in names if t.endswith("_assistant") and "glimmer" in t]
    arch = ", ".join(raw.get("architectures") or []) or "unknown architecture"
    return False, (f"transformers {version} implements speculation_type='dflash' only for drafts with a DFlash "
                   f"forward (model types: {', '.join(dflash_types) or 'none'}); this draft ({arch}, model_type "
                   f"{model_type!r}) is in the z-lab layout, which transformers loads as a plain "
                   f"{cls_name or 'unknown'} model")
