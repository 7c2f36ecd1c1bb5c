"""Fast path (#23): speculant against the reference ``dflash`` loop and the libraries' own plain
decoding, on identical weights and prompts, interleaved in one process.

    python benchmarks/fast_path.py [--backend mlx[,torch]] [--device cpu] [--dtype float32]
                                   [--repeats 3] [--max-new-tokens 32] [--block-size 8]
                                   [--pairs shipped,mid] [--hidden 1024] [--layers 8]
                                   [--family qwen3] [--sliding-window 128]
                                   [--compile auto|on|off[,...]] [--verifier auto[,adaptive]]
                                   [--draft-ahead auto[,off,on]] [--no-reference] [--small]

Arms, per backend and pair, run round-robin within every repeat (machine drift hits them alike):
``speculant plain`` and ``speculant dflash`` (the engine, ``backend.compile`` as given; with several
settings, e.g. ``--compile off,on``, a pair of speculant arms per setting, named ``[on]`` etc.; with
several verifiers, e.g. ``--verifier auto,adaptive``, one more dflash arm per extra kind, ``<adaptive>``;
``--draft-ahead auto,off`` likewise, ``<ahead off>``),
the library's own plain decoding (mlx-lm ``generate_step`` on MLX, transformers ``generate`` on
PyTorch), and the reference ``dflash`` 0.1.0 loop and its own plain baseline (mlx-lm
``generate_step`` on MLX, ``dflash_generate`` at block 1 on PyTorch). The reference needs
transformers 5.15, so it runs in a persistent worker process under the reference venv
(``scripts/make_reference_venv.sh``; ``$SPECULANT_REF_VENV`` or ``.ref-venv``), started once,
which loads the weights once and answers one run per request; its timings exclude loading like
ours. Decode tok/s = (new tokens - 1) / seconds after the first token.

Pairs: ``shipped`` (speculant's embedded target and its DFlash draft, a held-out code prompt)
and ``mid`` (a random Qwen3 target of ``--hidden``/``--layers``, about 12 x hidden^2 x layers
parameters, planted so that its random DFlash draft's blocks are mostly accepted; see mid_pair).
Ratios are medians (and min-max) over repeats of the ratio within one repeat. ``identical``
says whether every arm's tokens equal ``speculant plain``'s (the first --max-new-tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- pairs -------------------------------------------------------------------------------------

def shipped_pair(prompt_len: int) -> tuple[Path, Path, list[int]]:
    from speculant.embedded import PAIR_DIR
    from speculant.training.command import corpus_prompts

    prompt = corpus_prompts(PAIR_DIR / "target", 1, prompt_len, seed=1234, held_out=True)[0].tolist()
    return PAIR_DIR / "target", PAIR_DIR / "dflash", prompt


def mid_pair(root: Path, hidden: int, layers: int, prompt_len: int, family: str = "qwen3",
             window: int = 128) -> tuple[Path, Path, list[int]]:
    """Random Qwen3 target (or another ``family``'s, sliding layers with ``window``), its residual
    writes scaled by 0.2 and a planted token in embedding and head (``plant_checkpoint``), so it
    mostly emits that token; a random DFlash draft with small layers (scale 0.1) over the same
    embedding and head proposes it too: blocks are mostly accepted whole (measured: mean
    acceptance 7.75 of 8 at 1024 x 8)."""
    from speculant.testing.tiny import build_tiny_dflash, build_tiny_target, plant_checkpoint
    from speculant.testing.tiny_families import build_tiny_family

    if family == "qwen3":
        target = build_tiny_target(root / "target", seed=0, hidden_size=hidden, num_layers=layers,
                                   max_position_embeddings=4096)
    else:
        target = build_tiny_family(root / "target", family, hidden_size=hidden, num_layers=layers,
                                   sliding_window=window, max_position_embeddings=4096, scale=1.0)
    plant_checkpoint(target, strength=4.0, soften=0.2)
    draft = build_tiny_dflash(root / "draft", target, seed=7, num_layers=2, block_size=16, scale=0.1)
    return target, draft, [10 + i % 200 for i in range(prompt_len)]


# -- arms in this process: each run returns (tokens, decode seconds) ---------------------------------

class Speculant:
    def __init__(self, backend: str, device: str, dtype: str, compile: str, target: Path, draft: Path | None,
                 block: int, plain_of: "Speculant | None" = None, verifier: str = "auto",
                 draft_ahead: str = "auto") -> None:
        import speculant

        if plain_of is not None:
            self.engine = plain_of.engine.without_drafter()
        else:
            config = {"backend": {"kind": backend, "device": device, "dtype": dtype, "compile": compile,
                                  "draft_ahead": draft_ahead},
                      "target": {"path": str(target)}, "verifier": {"kind": verifier}}
            if draft is not None:
                config["drafter"] = {"kind": "dflash", "path": str(draft), "block_size": block}
            self.engine = speculant.load_engine(config)
        self.acceptance: list[float] = []

    @property
    def fast_path(self) -> str:
        return self.engine.target.fast_path

    def run(self, prompt: list[int], max_new: int) -> tuple[list[int], float]:
        result = self.engine.run(prompt_ids=prompt, max_new_tokens=max_new, ignore_eos=True)
        self.acceptance.append(result.stats.mean_acceptance_length or 1.0)
        return list(result.token_ids), (result.stats.new_tokens - 1) / result.stats.decode_tokens_per_s


class MlxLm:
    """mlx-lm's own ``generate_step`` (greedy), as the reference harness runs its baseline."""

    def __init__(self, device: str, dtype: str, target: Path, **_) -> None:
        import mlx.core as mx
        from mlx_lm import load

        if device in ("cpu", "auto") and not mx.metal.is_available():
            mx.set_default_device(mx.cpu)
        self.mx = mx
        self.model, _ = load(str(target))
        if dtype != "auto":
            self.model.set_dtype(getattr(mx, dtype))

    def run(self, prompt: list[int], max_new: int) -> tuple[list[int], float]:
        from mlx_lm.generate import generate_step

        mx, tokens, t_first = self.mx, [], None
        for token, _ in generate_step(mx.array(prompt), self.model, max_tokens=max_new,
                                      sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)):
            t_first = t_first or time.perf_counter()
            tokens.append(int(token))
        return tokens, time.perf_counter() - t_first


class Transformers:
    """transformers' ``generate`` (greedy, no EOS stop); the first new token is timed by a streamer."""

    def __init__(self, device: str, dtype: str, target: Path, **_) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        # use_kernels=False: the forward speculant's loader gives the target (transformers >= 5.25
        # would swap in kernels fetched from the Hub, unreachable from a benchmark machine)
        self.model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch_dtype, use_kernels=False)
        self.model = self.model.to(self.device).eval()
        self.model.generation_config.eos_token_id = None

    def run(self, prompt: list[int], max_new: int) -> tuple[list[int], float]:
        stamps: list[float] = []

        class Clock:  # put() gets the prompt first, then each new token (already on the host)
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                stamps.append(time.perf_counter())

        ids = self.torch.tensor([prompt], device=self.device)
        out = self.model.generate(ids, do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                                  pad_token_id=0, streamer=Clock())
        return out[0, len(prompt):].tolist(), stamps[-1] - stamps[1]


# -- the reference, in a worker process under the reference venv --------------------------------------

class ReferenceWorker:
    """``python fast_path.py --worker`` under the reference venv, one JSON line per request."""

    def __init__(self, python: Path) -> None:
        self.proc = subprocess.Popen([str(python), __file__, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(ROOT))

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the reference worker exited ({self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"reference worker: {answer['error']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Reference:
    def __init__(self, worker: ReferenceWorker, key: str, baseline: bool, block: int) -> None:
        self.worker, self.key, self.baseline, self.block = worker, key, baseline, block
        self.acceptance: list[float] = []

    def run(self, prompt: list[int], max_new: int) -> tuple[list[int], float]:
        out = self.worker.ask(op="run", key=self.key, prompt=prompt, max_new=max_new,
                              block=1 if self.baseline else self.block, baseline=self.baseline)
        if out["acceptance"]:
            self.acceptance.append(statistics.mean(out["acceptance"]))
        return out["tokens"], out["decode_s"]


def reference_python() -> tuple[Path | None, str]:
    venv = Path(os.environ.get("SPECULANT_REF_VENV") or ROOT / ".ref-venv")
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"no reference venv at {venv} (scripts/make_reference_venv.sh)"
    return python, str(venv)


# -- the run -------------------------------------------------------------------------------------

def build_arms(args, backend: str, pair: str, paths, worker: ReferenceWorker | None) -> dict:
    target, draft, _ = paths
    common = dict(device=args.device, dtype=args.dtype, target=target)
    arms = {}
    settings = args.compile.split(",")
    for setting in settings:
        suffix = f" [{setting}]" if len(settings) > 1 and setting != settings[0] else ""
        spec = Speculant(backend, args.device, args.dtype, setting, target, draft, args.block_size,
                         verifier=args.verifier.split(",")[0], draft_ahead=args.draft_ahead.split(",")[0])
        arms[f"speculant plain{suffix}"] = Speculant(backend, args.device, args.dtype, setting, target, None, 0, spec)
        arms[f"speculant dflash{suffix}"] = spec
    for verifier in args.verifier.split(",")[1:]:  # more verifiers, under the first compile setting
        arms[f"speculant dflash <{verifier}>"] = Speculant(backend, args.device, args.dtype, settings[0], target, draft,
                                                          args.block_size, verifier=verifier)
    for ahead in args.draft_ahead.split(",")[1:]:  # more draft_ahead settings, likewise
        arms[f"speculant dflash <ahead {ahead}>"] = Speculant(backend, args.device, args.dtype, settings[0], target,
                                                             draft, args.block_size, draft_ahead=ahead)
    library = "mlx-lm plain" if backend == "mlx" else "transformers plain"
    try:
        arms[library] = (MlxLm if backend == "mlx" else Transformers)(**common)
    except ValueError as error:  # e.g. mlx-lm's own load cannot read gpt-oss or Muse Glimmer as published
        print(f"{backend} / {pair}: {library} skipped: {str(error).splitlines()[0]}")
    if worker is not None:
        key = f"{backend}/{pair}"
        try:
            worker.ask(op="load", key=key, backend=backend, device=args.device, dtype=args.dtype,
                       target=str(target), draft=str(draft), threads=args.threads)
        except RuntimeError as error:
            why = [line for line in str(error).splitlines() if "Error" in line][-1:] or ["(no message)"]
            print(f"{backend} / {pair}: reference skipped: {why[0].strip()}")
            return arms
        arms["reference plain"] = Reference(worker, key, True, args.block_size)
        arms["reference dflash"] = Reference(worker, key, False, args.block_size)
    return arms


def measure(args, groups: dict) -> dict:
    """{group: {arm: {"rates": [...], "tokens": first run's tokens}}}, round-robin over repeats."""
    results = {g: {name: {"rates": [], "tokens": None} for name in arms} for g, (arms, _) in groups.items()}
    # Warm-up: one untimed run of each arm on the timed prompt and length, so that every verify
    # width a compiled backend traces (and MLX's first-call costs) stays out of the timings.
    for (arms, prompt) in groups.values():
        for arm in arms.values():
            arm.run(prompt, args.max_new_tokens)
    for repeat in range(args.repeats):
        for g, (arms, prompt) in groups.items():
            for name, arm in arms.items():
                tokens, seconds = arm.run(prompt, args.max_new_tokens)
                cell = results[g][name]
                cell["rates"].append((len(tokens) - 1) / seconds)
                cell["tokens"] = cell["tokens"] or tokens[: args.max_new_tokens]
        print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return results


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(group: str, arms: dict, cells: dict) -> None:
    rates = {name: cell["rates"] for name, cell in cells.items()}
    per = lambda a, b: [x / y for x, y in zip(rates[a], rates[b])]  # noqa: E731  (within each repeat)
    plain = cells["speculant plain"]["tokens"]
    print(f"\n{group}  (fast_path: {arms['speculant plain'].fast_path})")
    for name, cell in cells.items():
        tau = getattr(arms[name], "acceptance", [])
        extra = f", mean acceptance {statistics.median(tau):.2f}" if tau and "dflash" in name else ""
        same = "identical" if cell["tokens"] == plain else "DIFFERENT tokens"
        print(f"  {name:20s} {statistics.median(cell['rates']):8.1f} tok/s  "
              f"(runs {', '.join(f'{r:.1f}' for r in cell['rates'])}){extra}  {same}")
    library = "mlx-lm plain" if "mlx-lm plain" in rates else "transformers plain"
    if library in rates:
        print(f"  speculant plain / {library}: {spread(per('speculant plain', library))}")
    ours = per("speculant dflash", "speculant plain")
    print(f"  speculant dflash / speculant plain: {spread(ours)}")
    if "reference dflash" in rates:
        theirs = per("reference dflash", "reference plain")
        print(f"  reference dflash / reference plain: {spread(theirs)}")
        print(f"  speculant's speculative/plain over the reference's: {spread([a / b for a, b in zip(ours, theirs)])}")
        print(f"  speculant dflash / reference dflash (tok/s): {spread(per('speculant dflash', 'reference dflash'))}")
    for name in rates:
        if name.startswith("speculant dflash <") and "reference dflash" in rates:
            print(f"  {name} / reference dflash (tok/s): {spread(per(name, 'reference dflash'))}")
            print(f"  {name} / speculant plain: {spread(per(name, 'speculant plain'))}")
        if name.startswith("speculant") and "[" in name:
            base = name.split(" [")[0]
            print(f"  {name} / {base} ({arms[name].fast_path}): {spread(per(name, base))}")
    print(f"  identical tokens across arms: {all(c['tokens'] == plain for c in cells.values())}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mlx", help="mlx, torch, or both comma-separated")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, gpu (Metal) or auto")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--pairs", default="shipped,mid")
    parser.add_argument("--hidden", type=int, default=1024, help="mid pair: hidden size (1024 x 8 layers: ~100M)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--family", default="qwen3",
                        help="mid pair: the target's family (tiny_families: gemma3_text, mistral, gpt_oss, ...)")
    parser.add_argument("--sliding-window", type=int, default=128, help="mid pair: its sliding layers' window")
    parser.add_argument("--compile", default="auto",
                        help="backend.compile: auto, on or off; comma-separated to compare settings side by side")
    parser.add_argument("--verifier", default="auto",
                        help="verifier.kind of the speculant dflash arms; comma-separated adds an arm per extra kind "
                             "(e.g. auto,adaptive), under the first --compile setting")
    parser.add_argument("--draft-ahead", default="auto",
                        help="backend.draft_ahead of the speculant dflash arms; comma-separated adds an arm per extra "
                             "setting (e.g. auto,off), under the first --compile setting")
    parser.add_argument("--threads", type=int, default=2,
                        help="PyTorch intra-op threads on the CPU, for speculant's arms and the reference worker alike")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference dflash loop")
    parser.add_argument("--small", action="store_true", help="smoke run: 1 repeat, 8 tokens, a tiny mid pair")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if {"mlx", "torch"} <= set(args.backend.split(",")):
        # PyTorch's OpenMP workers spin after every op, taking cores from MLX (mlx_vs_torch.py). Only
        # then: with 2 threads, PASSIVE made every PyTorch forward of the shipped target 3x slower
        # (9.0 against 2.8 ms), each op waking a sleeping worker, for every arm, the reference's too.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.worker:
        return serve()
    if args.small:
        args.repeats, args.max_new_tokens, args.hidden, args.layers, args.prompt_len = 1, 8, 64, 4, 16
    worker = None
    if not args.no_reference:
        python, where = reference_python()
        if python is None:
            print(f"reference skipped: {where}")
        else:
            worker = ReferenceWorker(python)
    if "torch" in args.backend or "cuda" in args.device:
        import torch

        torch.set_num_threads(args.threads)
    groups = {}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = {}
        for pair in args.pairs.split(","):
            pairs[pair] = (shipped_pair(args.prompt_len) if pair == "shipped"
                           else mid_pair(Path(tmp) / pair, args.hidden, args.layers, args.prompt_len,
                                         args.family, args.sliding_window))
        for backend in args.backend.split(","):
            for pair, paths in pairs.items():
                groups[f"{backend} / {pair}"] = (build_arms(args, backend, pair, paths, worker), paths[2])
        from speculant.core.checkpoint import tensor_inventory

        for pair, (target, _, _) in pairs.items():
            count = sum(_product(shape) for _, shape in tensor_inventory(target).values())
            print(f"pair {pair}: target {count / 1e6:.1f}M parameters ({target})")
        print(f"{args.repeats} repeats, {args.max_new_tokens} new tokens, block {args.block_size}, {args.dtype}, "
              f"device {args.device}, compile {args.compile}, prompt {args.prompt_len} tokens", flush=True)
        results = measure(args, groups)
    for g, (arms, _) in groups.items():
        report(g, arms, results[g])
    if worker is not None:
        worker.close()


# -- the worker side (runs under the reference venv: imports dflash, never speculant) ------------------

def serve() -> None:
    """Answer JSON requests on stdin: ``load`` (weights once per key) and ``run`` (one generation)."""
    import traceback

    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # library prints must not reach the protocol
    loaded: dict = {}
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "load":
                loader = _load_mlx if request["backend"] == "mlx" else _load_torch
                loaded[request["key"]] = loader(request)
                answer = {"ok": True}
            else:
                answer = loaded[request["key"]](request)
        except Exception:
            answer = {"error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


def _load_mlx(request: dict):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    import dflash.model_mlx as ref

    if request["device"] in ("cpu", "auto") and not mx.metal.is_available():
        mx.set_default_device(mx.cpu)
    model, tokenizer = load(request["target"])
    tokenizer.eos_token_ids = set()
    hub = ref.snapshot_download
    ref.snapshot_download = lambda repo, *a, **k: repo if Path(repo).is_dir() else hub(repo, *a, **k)
    draft = ref.load_draft(request["draft"])
    if request["dtype"] != "auto":
        model.set_dtype(getattr(mx, request["dtype"]))
        draft.set_dtype(getattr(mx, request["dtype"]))

    def run(r: dict) -> dict:
        tokens, acceptance, t_first = [], [], None
        if r["baseline"]:
            steps = generate_step(mx.array(r["prompt"]), model, max_tokens=r["max_new"],
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
            for token, _ in steps:
                t_first = t_first or time.perf_counter()
                tokens.append(int(token))
        else:
            for response in ref.stream_generate(model, draft, tokenizer, r["prompt"], block_size=r["block"],
                                                max_tokens=r["max_new"], temperature=0.0):
                t_first = t_first or time.perf_counter()
                tokens.extend(int(t) for t in response.tokens)
                if response.accepted is not None:
                    acceptance.append(int(response.accepted))
        return {"tokens": tokens, "decode_s": time.perf_counter() - t_first, "acceptance": acceptance}

    return run


def _load_torch(request: dict):
    import torch
    from transformers import AutoModelForCausalLM

    import dflash.model as ref

    device = request["device"]
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if not device.startswith("cuda"):
        ref._cuda_time = time.perf_counter  # its timer synchronises CUDA
    if request.get("threads"):
        torch.set_num_threads(request["threads"])  # the same intra-op threads as speculant's arms
    dtype = torch.float32 if request["dtype"] == "auto" else getattr(torch, request["dtype"])
    target = AutoModelForCausalLM.from_pretrained(request["target"], dtype=dtype, attn_implementation="sdpa")
    draft = ref.DFlashDraftModel.from_pretrained(request["draft"], dtype=dtype)
    target, draft = target.to(device).eval(), draft.to(device).eval()

    def run(r: dict) -> dict:
        with torch.inference_mode():
            stats = ref.dflash_generate(draft, target, torch.tensor([r["prompt"]], device=device),
                                        max_new_tokens=r["max_new"], stop_token_ids=None, temperature=0.0,
                                        block_size=r["block"], return_stats=True)
        tokens = stats.output_ids[0, len(r["prompt"]):].tolist()
        acceptance = [] if r["baseline"] else [int(a) for a in stats.acceptance_lengths]
        return {"tokens": tokens, "decode_s": stats.time_per_output_token * stats.num_output_tokens,
                "acceptance": acceptance}

    return run


if __name__ == "__main__":
    main()
