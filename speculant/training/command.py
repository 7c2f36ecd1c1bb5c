"""``speculant train tokenizer | target | dflash | dflash2 | mtp | evaluate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a tokenizer, a small target or a drafter")
    steps = train.add_subparsers(dest="train_command", required=True, metavar="WHAT")

    tok = steps.add_parser("tokenizer", help="byte-level BPE on the Python standard library")
    tok.add_argument("--out", required=True, type=Path)
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument("--include-tests", action="store_true")
    tok.set_defaults(func=cmd_tokenizer)

    data = steps.add_parser("data", help="chat prompts and the target's own greedy answers (resumable)")
    data.add_argument("--target", required=True, type=Path, help="a chat model folder (config.json, tokenizer, chat template)")
    data.add_argument("--out", required=True, type=Path)
    data.add_argument("--prompts", type=int, default=2048, help="training prompts to answer")
    data.add_argument("--held-out", type=int, default=32, help="evaluation prompts kept out of training")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--batch", type=int, default=32, help="prompts the target answers at once")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                      help="the target's dtype while answering (bfloat16 is ~2x faster on CPUs with avx512_bf16)")
    data.add_argument("--max-batches", type=int, help="stop this run after this many new batches (rerun to continue)")
    data.add_argument("--max-seconds", type=float, help="stop this run after the batch that passes this time (rerun to continue)")
    data.add_argument("--sampled-rounds", type=int, default=0, metavar="N", help="then N more sampled answers per prompt")
    data.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled rounds")
    data.set_defaults(func=cmd_data)

    tgt = steps.add_parser("target", help="pretrain a small Qwen3 target on the corpus")
    tgt.add_argument("--tokenizer", required=True, type=Path)
    tgt.add_argument("--out", required=True, type=Path)
    tgt.add_argument("--hidden-size", type=int, default=256)
    tgt.add_argument("--layers", type=int, default=8)
    tgt.add_argument("--seq-len", type=int, default=256)
    tgt.add_argument("--batch", type=int, default=8)
    _loop_flags(tgt, steps=2000, lr=1e-3)
    tgt.set_defaults(func=cmd_target)

    dfl = _drafter_parser(steps, "dflash", "train a DFlash drafter against a local target", block=True)
    dfl.add_argument("--init-from", type=Path, metavar="DFLASH_DIR",
                     help="continue from a trained DFlash draft of the same target and shape (e.g. on more data)")
    _loop_flags(dfl, steps=1000, lr=6e-4)
    dfl.set_defaults(func=cmd_dflash)

    dfl2 = _drafter_parser(steps, "dflash2", "train a DFlash2 drafter (convolutions + candidate selector) against a local target",
                           block=True)
    dfl2.add_argument("--conv-kernel-size", type=int, default=2)
    dfl2.add_argument("--conv-group-size", type=int, default=16)
    dfl2.add_argument("--selector-rank", type=int, default=32)
    dfl2.add_argument("--selector-top-k", type=int, default=8)
    dfl2.add_argument("--selector-weight", type=float, default=1.0, help="weight of the selector cross-entropy")
    dfl2.add_argument("--init-from", type=Path, metavar="DFLASH_DIR",
                      help="start the backbone from a trained DFlash draft of the same target and shape")
    _loop_flags(dfl2, steps=1000, lr=6e-4)
    dfl2.set_defaults(func=cmd_dflash2)

    mtp = _drafter_parser(steps, "mtp", "train a Qwen-layout MTP head (mtp.*) against a local target", block=False)
    _loop_flags(mtp, steps=1000, lr=6e-4)
    mtp.set_defaults(func=cmd_mtp)

    ev = steps.add_parser("evaluate", help="mean acceptance length on held-out files")
    ev.add_argument("--target", required=True, type=Path)
    ev.add_argument("--draft", required=True, type=Path)
    ev.add_argument("--drafter", default="dflash")
    ev.add_argument("--block-size", type=int)
    ev.add_argument("--prompts", type=int, help="prompts to run (default: 8 corpus windows, or every held-out chat prompt)")
    ev.add_argument("--max-new-tokens", type=int, default=128)
    ev.add_argument("--data", type=Path, metavar="DATA_DIR",
                    help="run the held-out chat prompts of `speculant train data` (greedy, to their end token)")
    ev.add_argument("--dtype", choices=["float32", "bfloat16"], help="the target's dtype (default: the backend's)")
    ev.set_defaults(func=cmd_evaluate)

    ex = steps.add_parser("export", help="a trained draft as shipped: bfloat16 weights, config and a manifest")
    ex.add_argument("--draft", required=True, type=Path, help="a finished `train dflash|dflash2` folder")
    ex.add_argument("--out", required=True, type=Path)
    ex.add_argument("--evaluation", type=Path, help="the JSON `train evaluate` printed for this draft")
    ex.set_defaults(func=cmd_export)


def _drafter_parser(steps, name: str, help: str, block: bool):
    """The flags every drafter trainer shares; ``block`` adds the DFlash-family shape flags."""
    parser = steps.add_parser(name, help=help)
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    if block:
        parser.add_argument("--block-size", type=int, default=8)
        parser.add_argument("--layers", type=int, default=2)
        parser.add_argument("--features", type=int, default=3, help="number of target layers read")
        parser.add_argument("--target-layer-ids", type=_layer_ids, metavar="IDS",
                            help="comma-separated target layers to read, e.g. 1,4,7 (sets --features); "
                                 "default: the published spacing 1..N-3")
        parser.add_argument("--anchors", type=int, default=32, help="anchors per sequence and step")
        parser.add_argument("--sliding-window", type=int, metavar="N",
                            help="draft layers attend to the last N-1 context rows, in training and inference "
                                 "(default: all for DFlash, 2048 for DFlash2)")
        parser.add_argument("--mask-token-id", type=int, metavar="ID",
                            help="the block placeholder's token id, for a target whose tokenizer has no <|mask|> "
                                 "token (an id it never writes, e.g. an unused special token)")
        parser.add_argument("--data", type=Path, metavar="DATA_DIR",
                            help="train on the chat prompts + target answers of `speculant train data` (the loss "
                                 "covers answer tokens) instead of corpus windows the target continues")
    _sequence_flags(parser)
    parser.add_argument("--batch", type=int, default=4)
    return parser


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated layer ids such as 1,4,7") from None


def _block_shape_flags(args) -> dict:
    """``num_features``, ``target_layer_ids`` (explicit ids set the count) and, when given,
    ``sliding_window`` and ``mask_token_id`` of a DFlash-family shape."""
    ids = args.target_layer_ids
    flags = {"num_features": len(ids) if ids else args.features, "target_layer_ids": ids}
    for name in ("sliding_window", "mask_token_id"):
        if getattr(args, name) is not None:
            flags[name] = getattr(args, name)
    return flags


def _sequence_flags(parser) -> None:
    parser.add_argument("--sequences", type=int, default=512, help="target-generated training sequences")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=192)
    parser.add_argument("--sequences-file", type=Path,
                        help="cache of the generated sequences (.npy), shareable between drafters; default OUT/sequences.npy")
    parser.add_argument("--generate-batch", type=int, default=64,
                        help="prompts the target continues at once while making the sequences (256 is ~40%% faster "
                             "on a 2-core CPU; batch shapes can move float near-ties, so a rerun keeps the batch)")


def _loop_flags(parser, steps: int, lr: float) -> None:
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp32", action="store_true", help="train in float32 instead of bf16 autocast")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--stop-at", type=int, help="stop this run at this step (resumable), keeping the schedule")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS", help="lower --steps to what fits (timed first)")


def _settings(args):
    from speculant.training.loop import TrainSettings

    return TrainSettings(steps=args.steps, lr=args.lr, seed=args.seed, bf16=not args.fp32,
                         checkpoint_every=args.checkpoint_every, stop_at=args.stop_at, time_budget=args.time_budget)


def corpus_texts(held_out: bool = False, include_tests: bool = False) -> list[str]:
    from speculant.training.corpus import read_text, split, stdlib_files

    train, held = split(stdlib_files(include_tests=include_tests))
    return [t for t in map(read_text, held if held_out else train) if t]


def cmd_tokenizer(args) -> int:
    from speculant.training.corpus import split, stdlib_files, write_manifest
    from speculant.training.tokenizer import train_tokenizer

    train, held = split(stdlib_files(include_tests=args.include_tests))
    train_tokenizer(corpus_texts(include_tests=args.include_tests), args.out, args.vocab_size)
    write_manifest(args.out / "corpus.json", train, held, {"vocab_size": args.vocab_size, "include_tests": args.include_tests})
    print(f"tokenizer saved to {args.out}")
    return 0


def cmd_data(args) -> int:
    from speculant.training.data import DataSettings, generate_data

    flags = ("prompts", "held_out", "seed", "batch", "max_new_tokens", "dtype", "max_batches", "max_seconds",
             "sampled_rounds", "temperature")
    manifest = generate_data(DataSettings(target=args.target, out=args.out, **{k: getattr(args, k) for k in flags}),
                             command=["speculant", *sys.argv[1:]])
    print(f"{args.out}: {manifest['answers']} answers ({manifest['answer_tokens']:,} tokens) of "
          f"{manifest['train_prompts']} training prompts; {manifest['held_out_prompts']} held out")
    return 0


def cmd_export(args) -> int:
    from speculant.training.export import export_draft

    print(f"draft exported to {export_draft(args.draft, args.out, args.evaluation)}")
    return 0


def cmd_target(args) -> int:
    from transformers import AutoTokenizer

    from speculant.training.target import TargetShape, encode_corpus, train_target

    stream_file = args.out / "corpus_tokens.npy"
    if stream_file.exists():
        stream = np.load(stream_file)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        stream = encode_corpus(AutoTokenizer.from_pretrained(str(args.tokenizer)), corpus_texts())
        np.save(stream_file, stream)
    heads = max(2, args.hidden_size // 64)
    shape = TargetShape(hidden_size=args.hidden_size, num_hidden_layers=args.layers, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 2), head_dim=64, intermediate_size=3 * args.hidden_size)
    path = train_target(args.tokenizer, stream, args.out, shape, _settings(args), args.batch, args.seq_len)
    print(f"target saved to {path} ({len(stream):,} corpus tokens)")
    return 0


def cmd_dflash(args) -> int:
    from speculant.training.dflash import DFlashShape, train_dflash

    sequences, prompt_len, lengths = training_rows(args)
    shape = DFlashShape(args.layers, args.block_size, anchors_per_sequence=args.anchors, **_block_shape_flags(args))
    path = train_dflash(args.target, sequences, prompt_len, args.out, shape, _settings(args), args.batch,
                        init_from=args.init_from, lengths=lengths)
    record_provenance(path, args)
    print(f"draft saved to {path}")
    return 0


def cmd_dflash2(args) -> int:
    from speculant.training.dflash2 import DFlash2Shape, train_dflash2

    sequences, prompt_len, lengths = training_rows(args)
    shape = DFlash2Shape(num_layers=args.layers, block_size=args.block_size, **_block_shape_flags(args),
                         anchors_per_sequence=args.anchors, conv_kernel_size=args.conv_kernel_size,
                         conv_group_size=args.conv_group_size, selector_rank=args.selector_rank,
                         selector_top_k=args.selector_top_k, selector_weight=args.selector_weight)
    path = train_dflash2(args.target, sequences, prompt_len, args.out, shape, _settings(args), args.batch,
                         init_from=args.init_from, lengths=lengths)
    record_provenance(path, args)
    print(f"DFlash2 draft saved to {path}")
    return 0


def training_rows(args) -> tuple[np.ndarray, int | np.ndarray, np.ndarray | None]:
    """(sequences, prompt length(s), valid lengths or None): from ``--data`` (chat prompts and
    the target's answers, right padded) or from corpus windows the target continues."""
    if getattr(args, "data", None) is None:
        return target_sequences(args), args.prompt_len, None
    from speculant.training.data import read_answers

    data = read_answers(args.data)
    args.out.mkdir(parents=True, exist_ok=True)
    return data.sequences, data.prompt_lengths, data.lengths


def sequences_file(args) -> Path:
    return args.sequences_file or args.out / "sequences.npy"


def sequences_provenance(seq_file: Path) -> Path:
    """The JSON beside a sequence cache that says how its sequences were made."""
    return seq_file.with_suffix(".json")


def describe_sequences(args) -> str:
    """How this run would make its sequences (the sequence cache's provenance)."""
    return (f"{args.sequences} windows of {args.prompt_len} corpus tokens (seed {args.seed}) "
            f"continued greedily for {args.response_len} tokens by the target model (folder {Path(args.target).name}, "
            f"{args.generate_batch} at a time)")


def record_provenance(draft_dir: Path, args) -> None:
    """Say in the draft's training.json which sequence file it learned from, and how that was
    made: from the provenance written beside the file when it was generated (a later run's
    --seed is its training seed, not the one the cached sequences were drawn with). A run
    continued from another draft (--init-from) also carries that draft's training.json, so
    the whole chain of runs is in the last one."""
    info_file = Path(draft_dir) / "training.json"
    if not info_file.exists():  # not the main process
        return
    info = json.loads(info_file.read_text())
    if getattr(args, "data", None) is not None:
        _record_data(info, Path(args.data))
    else:
        _record_sequence_file(info, sequences_file(args))
    init_from = getattr(args, "init_from", None)
    parent = Path(init_from) / "training.json" if init_from else None
    if parent is not None:
        info["init_from_training"] = (json.loads(parent.read_text()) if parent.exists()
                                      else "unknown: the folder has no training.json")
    info_file.write_text(json.dumps(info, indent=1))


def _record_data(info: dict, data_dir: Path) -> None:
    from speculant.training.data import MANIFEST_FILE

    manifest = json.loads((data_dir / MANIFEST_FILE).read_text())
    info["data"] = {k: manifest[k] for k in ("made_by", "command", "licences", "prompt_sources", "train_prompts",
                                             "held_out_prompts", "answers", "answer_tokens") if k in manifest}
    info["data"]["folder"] = data_dir.name


def _record_sequence_file(info: dict, seq_file: Path) -> None:
    provenance = sequences_provenance(seq_file)
    info["sequences_file"] = seq_file.name
    info["sequences_made_by"] = (json.loads(provenance.read_text())["made_by"] if provenance.exists()
                                 else "unknown: the cache has no provenance file beside it")


def target_sequences(args) -> np.ndarray:
    """Corpus prompts continued greedily by the target itself, cached in ``--sequences-file``
    (default ``--out``/sequences.npy); a cached file must match the requested shape."""
    from speculant.training.dflash import generate_sequences
    from speculant.training.features import load_frozen_target

    args.out.mkdir(parents=True, exist_ok=True)
    seq_file = sequences_file(args)
    shape = (args.sequences, args.prompt_len + args.response_len)
    if seq_file.exists():
        sequences = np.load(seq_file)
        if sequences.shape != shape:
            raise SystemExit(f"{seq_file} holds sequences of shape {sequences.shape}, not {shape} "
                             "(--sequences, --prompt-len + --response-len): delete it or change the flags")
        return sequences
    prompts = corpus_prompts(args.target, args.sequences, args.prompt_len, args.seed)
    sequences = generate_sequences(load_frozen_target(args.target), prompts, args.response_len, args.generate_batch)
    seq_file.parent.mkdir(parents=True, exist_ok=True)
    np.save(seq_file, sequences)
    sequences_provenance(seq_file).write_text(json.dumps({"made_by": describe_sequences(args)}, indent=1))
    return sequences


def cmd_mtp(args) -> int:
    from speculant.training.mtp import MTPShape, train_mtp

    sequences = target_sequences(args)
    path = train_mtp(args.target, sequences, args.prompt_len, args.out, MTPShape(), _settings(args), args.batch)
    record_provenance(path, args)
    print(f"MTP head saved to {path} (drafter = {{kind = \"mtp\", path = \"{path}\"}})")
    return 0


def corpus_prompts(target_dir: Path, count: int, length: int, seed: int, held_out: bool = False) -> np.ndarray:
    """Random windows of the (training or held-out) corpus, tokenized by the target's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    rng = np.random.default_rng(seed)
    texts = corpus_texts(held_out=held_out)
    encoded: dict[int, np.ndarray] = {}  # each file tokenized once (thousands of windows share files)
    prompts = []
    while len(prompts) < count:
        index = int(rng.integers(len(texts)))
        if index not in encoded:
            encoded[index] = np.asarray(tokenizer.encode(texts[index], add_special_tokens=False), dtype=np.int32)
        ids = encoded[index]
        if len(ids) > length + 1:
            start = rng.integers(0, len(ids) - length)
            prompts.append(ids[start : start + length])
    return np.asarray(prompts, dtype=np.int32)


def cmd_evaluate(args) -> int:
    import speculant

    config = {"target": {"path": str(args.target)},
              "drafter": {"kind": args.drafter, "path": str(args.draft), "block_size": args.block_size}}
    if args.dtype:
        config["backend"] = {"kind": "torch", "dtype": args.dtype}
    engine = speculant.load_engine(config)
    taus, cycles, decode_rates = [], [], []
    for prompt in evaluation_prompts(args):
        # chat answers stop at their end token, as in use; corpus windows run the full length
        stats = engine.run(prompt_ids=prompt, max_new_tokens=args.max_new_tokens, ignore_eos=args.data is None).stats
        taus.append(stats.mean_acceptance_length)
        cycles.extend(stats.acceptance_lengths)
        decode_rates.append(stats.decode_tokens_per_s)
    result = {"mean_acceptance_length": float(np.mean(taus)), "pooled_acceptance_length": float(np.mean(cycles)),
              "decode_tokens_per_s": float(np.median(decode_rates)), "per_prompt": taus, "prompts": len(taus),
              "held_out": str(args.data) if args.data else "corpus windows of held-out stdlib files",
              "max_new_tokens": args.max_new_tokens}
    print(json.dumps(result, indent=1))
    return 0


def evaluation_prompts(args) -> list[list[int]]:
    """The held-out chat prompts of ``--data`` through the chat template, or windows of held-out corpus files."""
    if args.data is None:
        return [p.tolist() for p in corpus_prompts(args.target, args.prompts or 8, 64, seed=1234, held_out=True)]
    from transformers import AutoTokenizer

    from speculant.training.data import held_out_prompt_ids

    prompts = held_out_prompt_ids(args.data, AutoTokenizer.from_pretrained(str(args.target)))
    return prompts[: args.prompts] if args.prompts else prompts
