"""Convert a llama-architecture GGUF file (llama.cpp's format) into an ordinary Hugging Face
folder: ``config.json``, ``generation_config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json``. numpy and the ``gguf`` package only (no torch), so an MLX-only install
converts too.

Two things a plain GGUF load gets wrong, fixed here:

- llama.cpp's HF->GGUF converter permutes the rows of every ``attn_q`` / ``attn_k`` weight (each
  head's rotary halves interleaved, llama.cpp's rope layout); :func:`unpermute_rows` undoes it.
- the GGUF names the pre-tokenizer (``tokenizer.ggml.pre``, e.g. ``smollm``) instead of storing
  it; :data:`PRE_TOKENIZERS` restores the published form (SmolLM: each digit its own pre-token,
  then byte-level), which transformers' own GGUF tokenizer converter drops.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np

DTYPES = {"float32": "F32", "bfloat16": "BF16"}
# tokenizer.ggml.pre -> tokenizers' pre_tokenizer JSON; SmolLM's as in its published tokenizer.json
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]},
    "gpt-2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
}
_CONTROL_TOKEN = 3  # llama.cpp's token type of special (control) tokens
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class ConversionError(ValueError):
    """The GGUF file is not one this converter handles."""


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> None:
    """Write a Hugging Face llama folder for the GGUF at ``gguf_path`` into ``out_dir`` (created),
    weights in ``dtype`` (``float32``: the dequantized values exactly; ``bfloat16``: rounded)."""
    from gguf import GGUFReader

    if dtype not in DTYPES:
        raise ConversionError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    meta = metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = model_config(meta, tied="output.weight" not in tensors, dtype=dtype)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    write_tokenizer(meta, out)
    write_safetensors(out / "model.safetensors", _hf_tensors(tensors, config), DTYPES[dtype])


def metadata(reader: Any) -> dict[str, Any]:
    """The GGUF's key/value metadata as Python values (token lists included)."""
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    if meta.get("general.architecture") != "llama":
        raise ConversionError(f"only llama-architecture GGUF files convert; this one is {meta.get('general.architecture')!r}")
    return meta


def model_config(meta: dict[str, Any], tied: bool, dtype: str) -> dict[str, Any]:
    """config.json in the published llama layout (top-level rope_theta, read by every loader)."""
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu", "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)), "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": tied, "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id", meta["tokenizer.ggml.eos_token_id"])),
        "initializer_range": 0.02, "use_cache": True, "dtype": dtype,
    }


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: it stores each head's rows as (half, 2) pairs where
    the Hugging Face layout has (2, half)."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """HF name -> (shape, a function producing the float32 array), in a stable order."""
    from gguf.quants import dequantize

    def load(tensor: Any, heads: int | None = None):
        def make() -> np.ndarray:
            array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            array = array.reshape(tuple(int(n) for n in reversed(tensor.shape)))
            return unpermute_rows(array, heads) if heads else array
        return make

    out: dict[str, tuple[tuple[int, ...], Any]] = {}
    for name, tensor in tensors.items():
        shape = tuple(int(n) for n in reversed(tensor.shape))
        if name == "token_embd.weight":
            out["model.embed_tokens.weight"] = (shape, load(tensor))
        elif name == "output_norm.weight":
            out["model.norm.weight"] = (shape, load(tensor))
        elif name == "output.weight":
            out["lm_head.weight"] = (shape, load(tensor))
        elif name.startswith("blk.") and name.endswith(".weight"):
            _, layer, kind, _ = name.split(".")
            if kind not in _LAYER_NAMES:
                raise ConversionError(f"unknown llama tensor {name!r} in the GGUF file")
            heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(kind)
            out[f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"] = (shape, load(tensor, heads))
        elif name != "rope_freqs.weight":  # llama.cpp's precomputed rope table: the config holds it
            raise ConversionError(f"unknown tensor {name!r} in the GGUF file")
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], Any]], dtype: str) -> None:
    """Stream ``tensors`` (name -> (shape, make_float32_array)) into one safetensors file, one
    tensor in memory at a time. Written by hand: numpy has no bfloat16."""
    size = 4 if dtype == "F32" else 2
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, _) in tensors.items():
        end = offset + size * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, (shape, make) in tensors.items():
            array = make()
            if array.shape != shape:
                raise ConversionError(f"{name}: shape {array.shape}, expected {shape}")
            f.write(np.ascontiguousarray(array if dtype == "F32" else to_bfloat16_bits(array)).tobytes())


def to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even like torch's cast."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json (byte-level BPE, the named pre-tokenizer restored) and tokenizer_config.json
    (special tokens and the chat template)."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ConversionError(f"only byte-level BPE (gpt2) GGUF tokenizers convert; got {meta.get('tokenizer.ggml.model')!r}")
    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in PRE_TOKENIZERS:
        raise ConversionError(f"unknown GGUF pre-tokenizer {pre_name!r}; known: {', '.join(PRE_TOKENIZERS)}")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    special = [(i, t) for i, (t, kind) in enumerate(zip(tokens, types)) if kind == _CONTROL_TOKEN]
    data = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in special],
        "normalizer": None, "pre_tokenizer": PRE_TOKENIZERS[pre_name],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": list(meta["tokenizer.ggml.merges"])},
    }
    _write_json(out / "tokenizer.json", data, indent=None)
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, tokens, [t for _, t in special]))


def tokenizer_config(meta: dict[str, Any], tokens: list[str], special: list[str]) -> dict[str, Any]:
    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"), "eos_token": token("eos"),
        "pad_token": token("padding") or token("eos"), "unk_token": token("unknown"),
        "additional_special_tokens": [t for t in special if t.startswith("<|im_")],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    path.write_text(json.dumps(data, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def tensor_names(out_dir: str | Path) -> Iterator[str]:
    """Names in a written safetensors file (for checks)."""
    with open(Path(out_dir) / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        yield from (k for k in json.loads(f.read(length)) if k != "__metadata__")
