"""What exact rollback costs on a hybrid (Qwen3.5: Gated DeltaNet 3 : 1 full attention) PyTorch target.

1. Per verify cycle: the verify forward with per-position recurrent states recorded
   (``TorchTarget.forward``), the same forward without recording (transformers' own chunked delta
   rule, which cannot be rolled back), and the crop that installs the state at the accepted length
   and trims the buffers. Shares are of the recording verify forward; the goal is <= 5 %.
2. End to end: speculative decoding with the planted drafter (the target's own greedy continuation,
   one planted mistake every ``--mistake-every`` cycles: high acceptance) against plain decoding of
   the same loaded target, tokens per second; outputs must be equal.

Medians over ``--repeats``. A random target of the chosen size is built under ``--folder``.

    python benchmarks/rollback_cost.py [--hidden 512 --layers 8 --block 8 --repeats 5 --device cpu
                                        --recording auto|loop|closed_form]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from speculant.backends.torch import rollback
from speculant.api import load_engine
from speculant.core.types import Capture
from speculant.testing.planted_drafter import registry_with_planted


def build_target(folder: Path, hidden: int, layers: int, heads: int) -> Path:
    """A random text-only Qwen3.5 target: linear_attention layers 3 : 1 full_attention."""
    import transformers

    from speculant.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer(folder)
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = transformers.Qwen3_5TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=hidden // heads,
        linear_num_key_heads=heads // 2, linear_num_value_heads=heads, linear_key_head_dim=hidden // heads,
        linear_value_head_dim=hidden // heads, linear_conv_kernel_dim=4, layer_types=kinds,
        max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 2.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def engine_config(path: Path, args, script=(), mistakes=(-1,)) -> dict:
    options = {"script": [list(map(list, s)) for s in script], "mistakes": list(mistakes), "default_block_size": args.block}
    return {"backend": {"kind": "torch", "device": args.device, "dtype": args.dtype}, "target": {"path": str(path)},
            "drafter": {"kind": "planted", "options": options}}


def timed(backend, fn) -> float:
    backend.synchronize()
    start = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - start


def cycle_costs(engine, prompt: list[int], args) -> dict[str, list[float]]:
    """Seconds per verify forward (recording / not) and per crop, rejecting at each block position."""
    target, backend = engine.target, engine.backend
    block = backend.int_array([(t * 7 + 3) % target.info.vocab_size for t in range(args.block)])
    costs: dict[str, list[float]] = {"verify": [], "plain forward": [], "crop": []}
    for _ in range(args.repeats):
        for accepted in range(args.block):
            target.reset()
            target.prefill(prompt)
            costs["verify"].append(timed(backend, lambda: target.forward(block)))
            costs["crop"].append(timed(backend, lambda: target.crop(len(prompt) + 1 + accepted)))
            target.reset()
            target.prefill(prompt)
            costs["plain forward"].append(timed(backend, lambda: target._run(block, Capture(), 0)))
    return costs


def decode_speed(path: Path, prompt: list[int], args) -> dict[str, float]:
    plain = load_engine(engine_config(path, args), registry=registry_with_planted()).without_drafter()
    reference = plain.run(prompt_ids=prompt, max_new_tokens=args.new_tokens, ignore_eos=True).token_ids
    mistakes = [-1] * (args.mistake_every - 1) + [args.block // 2] if args.mistake_every else [-1]
    spec = load_engine(engine_config(path, args, [(prompt, reference)], mistakes), registry=registry_with_planted())
    rates: dict[str, list[float]] = {"plain": [], "speculative": []}
    acceptance = 0.0
    for _ in range(args.repeats):
        for name, engine in (("plain", plain), ("speculative", spec)):
            result = engine.run(prompt_ids=prompt, max_new_tokens=args.new_tokens, ignore_eos=True)
            assert result.token_ids == reference, f"{name} output differs from plain decoding"
            rates[name].append(result.stats.decode_tokens_per_s)
            if name == "speculative":
                acceptance = result.stats.mean_acceptance_length
    return {"plain": statistics.median(rates["plain"]), "speculative": statistics.median(rates["speculative"]),
            "acceptance": acceptance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--mistake-every", type=int, default=4, help="a planted mistake every N cycles (0: none)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--recording", choices=("auto", "loop", "closed_form"), default="auto",
                        help="how the verify forward records states (auto: loop on CPU, closed form elsewhere)")
    parser.add_argument("--folder", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rollback.ROLLBACK.closed_form = {"auto": None, "loop": False, "closed_form": True}[args.recording]

    folder = args.folder or Path(tempfile.mkdtemp(prefix="rollback_cost_"))
    path = folder / f"qwen3_5_h{args.hidden}_l{args.layers}"
    if not (path / "config.json").exists():
        build_target(path, args.hidden, args.layers, args.heads)
    prompt = [(i * 37 + 11) % 300 for i in range(args.prompt_len)]
    engine = load_engine(engine_config(path, args), registry=registry_with_planted())

    costs = {k: statistics.median(v) * 1e3 for k, v in cycle_costs(engine, prompt, args).items()}
    verify = costs["verify"]
    recording = costs["verify"] - costs["plain forward"]
    print(f"target: Qwen3.5 text, hidden {args.hidden}, {args.layers} layers ({args.layers - args.layers // 4} "
          f"Gated DeltaNet), block {args.block}, prompt {args.prompt_len}, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads, recording: {args.recording}, medians of {args.repeats} x {args.block} cycles")
    print(f"{'per verify cycle':<44}{'ms':>9}{'share of verify':>17}")
    rows = [("verify forward, states recorded", verify), ("same forward, not recorded (chunked rule)", costs["plain forward"]),
            ("recording (difference)", recording), ("crop: install state + trim buffers", costs["crop"]),
            ("rollback total (recording + crop)", recording + costs["crop"])]
    for label, ms in rows:
        print(f"{label:<44}{ms:9.3f}{ms / verify:17.1%}")

    speed = decode_speed(path, prompt, args)
    print(f"\n{'decoding ' + str(args.new_tokens) + ' tokens':<44}{'tok/s':>9}")
    print(f"{'plain':<44}{speed['plain']:9.1f}")
    print(f"{'speculative, planted draft':<44}{speed['speculative']:9.1f}   "
          f"(mean acceptance {speed['acceptance']:.2f}, speed-up {speed['speculative'] / speed['plain']:.2f}x)")



if __name__ == "__main__":
    main()
