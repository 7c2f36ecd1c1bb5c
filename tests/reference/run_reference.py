"""Run the official reference package ``dflash`` 0.1.0 on local checkpoints and print JSON.

Runs inside the reference venv (scripts/make_reference_venv.sh), never under speculant's
interpreter. The installed package files are not edited; three runtime substitutions are made:

- torch: ``dflash.model._cuda_time`` (``torch.cuda.synchronize`` + perf_counter, used by the
  ``return_stats=True`` path) is replaced by a plain perf_counter timer on CPU;
- MLX: ``dflash.model_mlx.snapshot_download`` passes local folders through unchanged;
- both: the target's forward is observed (a torch forward pre-hook / a wrapper around the mlx-lm
  inner model) to record each verify call's input, whose tokens after the anchor are the drafted
  tokens before verification ("proposals"); with ``--capture-logits`` the draft's
  ``compute_logits`` is wrapped on the instance to record the draft logits rows. MLX with
  ``--timing`` leaves the target unwrapped (the wrapper's ``.tolist()`` waits on every input),
  so the loop is timed as shipped and ``proposals`` is null.

    python run_reference.py --backend torch|mlx --target DIR --draft DIR --prompt-ids 1,2,3 \
        --max-new-tokens N --block-size B --temperature T [--baseline] [--stop-token-ids 254]

Output (one JSON object on stdout): tokens (new tokens only), acceptance_lengths (per cycle,
accepted + 1, after truncation), proposals (per cycle, the drafted tokens), wall_s (generation
incl. prefill, excluding loading), decode_s (after the first token), ttft_s, plus run metadata.
``--batch FILE`` runs a JSON list of such argument lists in one process and prints a JSON list.
``--baseline``: torch runs ``dflash_generate`` at block size 1 (the reference benchmark's own
baseline); MLX runs stock ``mlx_lm.generate.generate_step`` (the MLX benchmark's baseline).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import sys
import time
from pathlib import Path
from typing import Any

DFLASH2 = "DFlash2DraftModel"


def _architecture(draft_dir: str) -> str:
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return DFLASH2 if DFLASH2 in (config.get("architectures") or []) else "DFlashDraftModel"


def _versions(names: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------- torch


def run_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    import dflash.model as ref

    torch.set_num_threads(args.threads)
    ref._cuda_time = time.perf_counter  # CPU timer in place of torch.cuda.synchronize

    architecture = _architecture(args.draft)
    draft_cls = ref.DFlash2DraftModel if architecture == DFLASH2 else ref.DFlashDraftModel
    target = AutoModelForCausalLM.from_pretrained(
        args.target, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    draft = draft_cls.from_pretrained(args.draft, dtype=torch.float32).eval()

    calls: list[list[int]] = []
    target.register_forward_pre_hook(
        lambda _module, inputs: calls.append(inputs[0][0].tolist()) if inputs else None
    )
    logits_rows = _wrap_torch_logits(draft) if args.capture_logits else None

    torch.manual_seed(args.seed)
    input_ids = torch.tensor([args.prompt_ids], dtype=torch.long)
    block_size = 1 if args.baseline else args.block_size
    t0 = time.perf_counter()
    stats = ref.dflash_generate(
        draft,
        target,
        input_ids,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=args.stop_token_ids or None,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        block_size=block_size,
        return_stats=True,
    )
    wall_s = time.perf_counter() - t0
    if not calls or calls[0] != list(args.prompt_ids):
        raise RuntimeError("the first target call was not the prompt prefill")
    out = {
        "tokens": stats.output_ids[0, len(args.prompt_ids):].tolist(),
        "acceptance_lengths": [int(a) for a in stats.acceptance_lengths],
        "proposals": [call[1:] for call in calls[1:]],
        "wall_s": wall_s,
        "decode_s": stats.time_per_output_token * stats.num_output_tokens,
        "ttft_s": stats.time_to_first_token,
        "block_size": block_size,
        "architecture": architecture,
    }
    if logits_rows is not None:
        out["draft_logits"] = logits_rows
    return out


def _wrap_torch_logits(draft) -> list:
    rows: list = []
    original = draft.compute_logits

    def compute_logits(hidden, output_head):
        logits = original(hidden, output_head)
        rows.append(logits[0].float().tolist())
        return logits

    draft.compute_logits = compute_logits
    return rows


# --------------------------------------------------------------------------- MLX


class _RecordingInner:
    """Stands in for mlx-lm's inner text model: records the token ids of every call."""

    def __init__(self, inner, calls: list):
        self._inner, self._calls = inner, calls

    def __call__(self, inputs, *args, **kwargs):
        self._calls.append(inputs[0].tolist())
        return self._inner(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _local_snapshot_download(original):
    if getattr(original, "_speculant_local", False):
        return original

    def snapshot_download(repo_id, *args, **kwargs):
        if Path(repo_id).is_dir():
            return str(repo_id)
        return original(repo_id, *args, **kwargs)

    snapshot_download._speculant_local = True
    return snapshot_download


def run_mlx(args: argparse.Namespace) -> dict[str, Any]:
    if not args.mlx_temporal_rotating_cache:
        return _run_mlx(args)
    from mlx_lm.models.cache import RotatingKVCache

    original = RotatingKVCache.update_and_fetch
    _force_temporal_rotating_cache()
    try:
        return _run_mlx(args)
    finally:
        RotatingKVCache.update_and_fetch = original


def _run_mlx(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load

    import dflash.model_mlx as ref

    mx.set_default_device(mx.cpu)
    ref.snapshot_download = _local_snapshot_download(ref.snapshot_download)
    architecture = _architecture(args.draft)
    model, tokenizer = load(args.target)
    tokenizer.eos_token_ids = set(args.stop_token_ids)
    calls: list[list[int]] = []
    if not args.timing:
        model.model = _RecordingInner(model.model, calls)
    mx.random.seed(args.seed)
    if args.baseline:
        return _run_mlx_baseline(args, model, calls, architecture)

    draft = ref.load_draft(args.draft)
    logits_rows = _wrap_mlx_logits(draft) if args.capture_logits else None
    tokens: list[int] = []
    acceptance_lengths: list[int] = []
    prefill_calls = None
    t0 = time.perf_counter()
    t_first = None
    for response in ref.stream_generate(
        model,
        draft,
        tokenizer,
        list(args.prompt_ids),
        block_size=args.block_size,
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    ):
        if t_first is None:
            t_first = time.perf_counter()
            prefill_calls = len(calls)
        tokens.extend(int(t) for t in response.tokens)
        if response.accepted is not None:
            acceptance_lengths.append(int(response.accepted))
    t_end = time.perf_counter()
    if not args.timing and sum(len(c) for c in calls[:prefill_calls]) != len(args.prompt_ids):
        raise RuntimeError("prefill calls do not cover the prompt")
    out = {
        "tokens": tokens,
        "acceptance_lengths": acceptance_lengths,
        "proposals": None if args.timing else [call[1:] for call in calls[prefill_calls:]],
        "wall_s": t_end - t0,
        "decode_s": t_end - t_first,
        "ttft_s": t_first - t0,
        "block_size": args.block_size,
        "architecture": architecture,
    }
    if logits_rows is not None:
        out["draft_logits"] = logits_rows
    return out


def _force_temporal_rotating_cache() -> None:
    """Opt-in correction, NOT reference behaviour: mlx-lm's ``RotatingKVCache`` returns its
    buffer in rotated (non-temporal) order when one row is appended after the window is full,
    and ``model_mlx.DFlashAttention`` applies its sliding mask by buffer index, so a draft with
    ``sliding_window - 1`` < context length hides the wrong context rows on cycles that commit a
    single token. Always taking the concatenating path keeps the buffer in temporal order; the
    MLX reference then matches the torch reference."""
    from mlx_lm.models.cache import RotatingKVCache

    RotatingKVCache.update_and_fetch = lambda self, keys, values: self._update_concat(keys, values)


def _wrap_mlx_logits(draft) -> list:
    import mlx.core as mx

    rows: list = []
    original = draft.compute_logits

    def compute_logits(hidden):
        logits = original(hidden)
        rows.append(logits[0].astype(mx.float32).tolist())
        return logits

    object.__setattr__(draft, "compute_logits", compute_logits)
    return rows


def _run_mlx_baseline(args, model, calls, architecture) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    if args.temperature > 0:
        sampler = make_sampler(args.temperature, top_p=args.top_p, top_k=args.top_k)
    else:
        sampler = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = None
    stop = set(args.stop_token_ids)
    for token, _ in generate_step(
        mx.array(list(args.prompt_ids)), model, max_tokens=args.max_new_tokens, sampler=sampler
    ):
        t_first = t_first or time.perf_counter()
        tokens.append(int(token))
        if tokens[-1] in stop:
            break
    t_end = time.perf_counter()
    return {
        "tokens": tokens,
        "acceptance_lengths": [1] * max(len(tokens) - 1, 0),
        "proposals": None if args.timing else [[] for _ in range(max(len(tokens) - 1, 0))],
        "wall_s": t_end - t0,
        "decode_s": t_end - t_first,
        "ttft_s": t_first - t0,
        "block_size": 1,
        "architecture": architecture,
    }


# --------------------------------------------------------------------------- CLI


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Run the reference dflash 0.1.0 and print JSON.")
    p.add_argument("--load-info", action="store_true",
                   help="only load --draft with the reference classes and report its keys")
    p.add_argument("--backend", choices=("torch", "mlx"))
    p.add_argument("--target")
    p.add_argument("--draft", required=True)
    p.add_argument("--prompt-ids", type=_ids)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--block-size", type=int, default=None,
                   help="verify width incl. the anchor; default: the draft's block_size")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-token-ids", type=_ids, default=[],
                   help="comma-separated; default none (generation runs to max-new-tokens)")
    p.add_argument("--baseline", action="store_true",
                   help="plain target decoding through the reference's own baseline path")
    p.add_argument("--capture-logits", action="store_true",
                   help="also return draft_logits: per draft call, rows x vocab floats")
    p.add_argument("--mlx-temporal-rotating-cache", action="store_true",
                   help="MLX only, opt-in correction (not reference behaviour): keep sliding-window "
                        "draft caches in temporal order; see _force_temporal_rotating_cache")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--timing", action="store_true",
                   help="MLX: time the loop as shipped, without the wrapper that records each target "
                        "call's token ids (its .tolist() waits for every input); proposals is null")
    args = p.parse_args(argv)
    if args.load_info:
        return args
    missing = [f"--{n.replace('_', '-')}" for n in ("backend", "target", "prompt_ids",
                                                    "max_new_tokens") if getattr(args, n) is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
    if args.block_size is None:
        args.block_size = _default_block_size(args.draft)
    return args


def _default_block_size(draft_dir: str) -> int:
    config = json.loads((Path(draft_dir) / "config.json").read_text())
    return int((config.get("dflash_config") or {}).get("block_size", config.get("block_size", 16)))


def load_info(args: argparse.Namespace) -> dict[str, Any]:
    """Torch: ``from_pretrained(output_loading_info=True)`` key report. MLX: ``load_draft``
    loads strictly (raises on any missing or unexpected tensor); report its parameter count."""
    import torch
    from mlx.utils import tree_flatten

    import dflash.model as ref
    import dflash.model_mlx as ref_mlx

    architecture = _architecture(args.draft)
    cls = ref.DFlash2DraftModel if architecture == DFLASH2 else ref.DFlashDraftModel
    _, info = cls.from_pretrained(args.draft, dtype=torch.float32, output_loading_info=True)
    ref_mlx.snapshot_download = _local_snapshot_download(ref_mlx.snapshot_download)
    mlx_draft = ref_mlx.load_draft(args.draft)
    return {
        "architecture": architecture,
        "torch": {key: sorted(str(k) for k in value) for key, value in info.items()},
        "mlx_parameters": len(tree_flatten(mlx_draft.parameters())),
    }


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    if args.load_info:
        return load_info(args)
    out = (run_torch if args.backend == "torch" else run_mlx)(args)
    out.update(
        backend=args.backend,
        temperature=args.temperature,
        baseline=args.baseline,
        mlx_temporal_rotating_cache=args.mlx_temporal_rotating_cache,
        num_input_tokens=len(args.prompt_ids),
        versions=_versions(("dflash", "torch", "transformers", "mlx", "mlx-lm")),
    )
    return out


def run_batch(path: str) -> list[dict[str, Any]]:
    """``--batch FILE`` (or ``-`` for stdin): a JSON list of argument lists, one per run; saves
    the interpreter start-up and imports per run. A failing run yields ``{"error": ...}``."""
    import traceback

    jobs = json.load(sys.stdin if path == "-" else open(path))
    results = []
    for argv in jobs:
        try:
            results.append(run_one(parse_args(argv)))
        except (Exception, SystemExit):  # noqa: BLE001 - reported per job, the batch goes on
            results.append({"error": traceback.format_exc(), "argv": argv})
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    stdout, sys.stdout = sys.stdout, sys.stderr  # library chatter must not corrupt the JSON
    try:
        if argv[:1] == ["--batch"] and len(argv) == 2:
            out: Any = run_batch(argv[1])
        else:
            out = run_one(parse_args(argv))
    finally:
        sys.stdout = stdout
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
