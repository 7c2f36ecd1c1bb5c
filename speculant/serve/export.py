"""``speculant export``: the same pairing as a launch command (vLLM, SGLang, llama.cpp) or per-model
settings (oMLX), with those projects' documented option names; what an engine cannot run is
refused with the reason. Reads config files only, never weights."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from speculant.core.config import EngineConfig, parse_quantization
from speculant.core.errors import SpeculantError
from speculant.core.lookup import DEFAULT_BLOCK_SIZE as LOOKUP_BLOCK

ENGINES = ("vllm", "sglang", "llama.cpp", "omlx")
DFLASH2_MLX_BLOCK = 5  # dflash-mlx caps DFlash 2 at block 5


class ExportError(SpeculantError):
    """The chosen engine cannot run this pairing; the message says why."""


@dataclass
class Pairing:
    target: str
    kind: str  # dflash | dflash2 | mtp | none
    draft: str | None
    block: int  # anchor + proposals
    lookup: tuple[int, int] | None  # (min_match, max_match) when prompt lookup is on
    weight_bits: int | None
    verifier: str


def pairing(config: EngineConfig) -> Pairing:
    d = config.drafter
    kind = d.kind if d.kind not in (None, "", "none") else "none"
    if kind not in ("dflash", "dflash2", "mtp", "none"):
        raise ExportError(f"drafter kind {kind!r} is a plugin of speculant's: none of vLLM, SGLang, llama.cpp or oMLX "
                          "runs it")
    draft = str(d.path) if d.path is not None and kind != "none" else None
    block = d.block_size or (_trained_block(kind, draft) if draft else LOOKUP_BLOCK)
    quant = parse_quantization(d.quantization)
    return Pairing(str(config.target.path), kind, draft, block,
                   (d.lookup.min_match, d.lookup.max_match) if d.lookup.enabled else None,
                   quant.weight_bits if quant else None, config.verifier.kind)


def _trained_block(kind: str, draft: str) -> int:
    try:
        cfg = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, ValueError):
        raise ExportError(f"cannot read {draft}/config.json to find the block size: set drafter.block_size") from None
    if kind == "mtp":
        layers = cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 1
        return int(layers) + 1
    block = cfg.get("block_size") or (cfg.get("dflash_config") or {}).get("block_size")
    if not block:
        raise ExportError(f"{draft}/config.json names no block_size: set drafter.block_size")
    return int(block)


def export(config: EngineConfig, engine: str) -> tuple[str, list[str]]:
    """``(command or settings, notes)`` that run ``config``'s pairing in ``engine``."""
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    p = pairing(config)
    notes: list[str] = []
    if p.lookup and p.kind != "none":
        notes.append(f"prompt lookup is not carried over: {engine} runs one speculative method at a time "
                     f"({p.kind} is exported)")
    if p.weight_bits and engine != "omlx":
        notes.append(f"the {p.weight_bits}-bit draft quantization is not carried over: {engine} loads the draft as stored")
    text = {"vllm": _vllm, "sglang": _sglang, "llama.cpp": _llama_cpp, "omlx": _omlx}[engine](p, notes)
    return text, notes


def _command(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def _vllm(p: Pairing, notes: list[str]) -> str:
    words = ["vllm", "serve", p.target]
    if p.kind == "none" and p.lookup is None:
        return _command(words)
    if p.kind == "none":
        spec = {"method": "ngram", "num_speculative_tokens": p.block - 1, "prompt_lookup_min": p.lookup[0],
                "prompt_lookup_max": p.lookup[1]}
    else:
        spec = {"method": "mtp" if p.kind == "mtp" else "dflash", "model": p.draft, "num_speculative_tokens": p.block - 1}
        if p.kind == "dflash2":
            notes.append("DFlash 2 runs as method 'dflash' in vLLM versions that merged it (the selector is "
                         "detected from the checkpoint's config)")
    return _command(words + ["--speculative-config", json.dumps(spec)])


def _sglang(p: Pairing, notes: list[str]) -> str:
    words = ["python", "-m", "sglang.launch_server", "--model-path", p.target]
    if p.kind in ("dflash2", "mtp"):
        raise ExportError(f"SGLang cannot run a {p.kind} draft: its speculative algorithms are DFLASH (DFlash v1), "
                          "EAGLE3, NGRAM and STANDALONE")
    if p.kind == "none" and p.lookup is None:
        return _command(words)
    if p.kind == "none":
        notes.append(f"SGLang's NGRAM has its own match settings: min_match {p.lookup[0]} / max_match "
                     f"{p.lookup[1]} are not carried over")
        return _command(words + ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(p.block)])
    return _command(words + ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", p.draft,
                             "--speculative-num-draft-tokens", str(p.block)])


def _llama_cpp(p: Pairing, notes: list[str]) -> str:
    if p.kind == "dflash2":
        raise ExportError("llama.cpp cannot run a DFlash 2 draft: its spec types are draft-dflash (v1), draft-mtp, "
                          "draft-eagle3 and ngram-*")
    if p.kind == "none" and p.lookup is not None:
        raise ExportError("llama.cpp's ngram-* spec types are not speculant's prompt lookup; speculant does not "
                          "pick one for you: run llama-server with the ngram type of your choice")
    target = _gguf(p.target)
    words = ["llama-server", "-m", target]
    notes.append("llama.cpp loads GGUF files: convert the target (and draft) with llama.cpp's convert_hf_to_gguf.py "
                 "to the .gguf paths shown")
    if p.kind == "none":
        return _command(words)
    spec = "draft-mtp" if p.kind == "mtp" else "draft-dflash"
    return _command(words + ["-md", _gguf(p.draft), "--spec-type", spec, "--draft-max", str(p.block - 1)])


def _gguf(folder: str) -> str:
    return str(Path(folder).with_suffix("")) + ".gguf"


def _omlx(p: Pairing, notes: list[str]) -> str:
    if p.kind == "mtp":
        raise ExportError("oMLX cannot run speculant's MTP draft: its DFlash engine takes DFlash / DFlash 2 drafts, "
                          "and its own MTP mode uses heads inside the target")
    if p.kind == "none" and p.lookup is not None:
        raise ExportError("oMLX has no prompt-lookup setting: export a DFlash or DFlash 2 pairing instead")
    settings: dict = {"dflash_enabled": p.kind != "none"}
    if p.kind != "none":
        block = p.block
        if p.kind == "dflash2" and block > DFLASH2_MLX_BLOCK:
            notes.append(f"dflash-mlx caps DFlash 2 at block {DFLASH2_MLX_BLOCK}: exported {DFLASH2_MLX_BLOCK} "
                         f"(speculant runs {block})")
            block = DFLASH2_MLX_BLOCK
        elif block > 5:
            notes.append(f"block size {block}: oMLX recommends 5 or less on MLX")
        settings.update({"dflash_draft_model": p.draft, "dflash_block_size": block,
                         "dflash_verify_mode": "adaptive" if p.verifier == "adaptive" else "dflash"})
        if p.weight_bits:
            settings.update({"dflash_draft_quant_enabled": True, "dflash_draft_quant_weight_bits": p.weight_bits})
    notes.append(f"per-model settings for oMLX's model_settings.json (model: {p.target})")
    return json.dumps(settings, indent=2)
