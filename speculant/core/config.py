"""The engine configuration: pydantic models for everything a user writes.

Load from TOML, YAML, JSON, a dict or a model; unknown keys are errors and every error
names the field path (``drafter.block_size``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from speculant.core.errors import ConfigError
from speculant.core.schema import CONTEXT_MAX, SEED_MAX, TOKEN_ID_MAX, LaxPath, UserModel, error_lines, sequence_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


BLOCK_SIZE_MAX = 256  # anchor + proposals verified in one forward; trained drafters use 16 or fewer
MATCH_MAX = 64  # prompt lookup indexes every min_match..max_match-gram of the context per token
TOP_K_MAX = 2**24  # more than any vocabulary
STOP_IDS_MAX = 1024
STOP_STRINGS_MAX = 256
STOP_STRING_CHARS = 1024  # the stream decoder holds back this much text while a stop string may start
MIN_TEMPERATURE = 1e-4
"""Smallest positive sampling temperature. Below it sampling is greedy in all but name (a logit
gap of 0.01 already weighs e^100), and near 1e-38 the logits divided by it overflow float32."""


class _Section(UserModel):
    # Each field's docstring is its description: docs/configuration.md is generated from them.
    model_config = ConfigDict(validate_assignment=True, use_attribute_docstrings=True)


class BackendConfig(_Section):
    """The array runtime that loads and runs the models."""

    kind: str = "torch"
    """A registered backend's name."""
    device: str = "auto"
    """`auto` (CUDA, then MPS, then CPU), `cpu`, `cuda`, `cuda:N`, `mps`, or `gpu` (MLX)."""
    dtype: str = "auto"
    """Model dtype; `auto` is bfloat16 on CUDA (float16 without bf16), float16 on MPS, float32 on CPU."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Compiled forwards (torch.compile per verify width over a static cache; on MLX, mx.compile
    of the whole forward over a static cache, a ring per sliding layer and Gated DeltaNet states
    passed through, else of its feed-forward blocks), the draft step following the target: `auto`
    where the backend's benchmark shows they pay (PyTorch: compiled on CUDA, eager on a CPU; MLX:
    compiled whole forwards on a CPU; on a CPU in float32, linear weights stored transposed or
    packed for oneDNN on PyTorch, stored transposed on MLX, whichever is timed fastest at load, if
    faster than as loaded; on MLX large products also split over the cores if timed faster; each
    timing made once per machine and model shape and kept in `$SPECULANT_HOME/timings.json`), `on`
    wherever possible (on a CPU over the linear weights' layout timed fastest), `off` never."""
    draft_ahead: Literal["auto", "on", "off"] = "auto"
    """Draft the next block before the host reads this cycle's verification, assuming the whole
    block is accepted (greedy, fixed-width verifiers; kept only when it was): `auto` on GPUs (Metal,
    CUDA, MPS), where the host's work can overlap the device's; `on`; `off`."""


class TargetConfig(_Section):
    """The model whose output speculant reproduces."""

    path: LaxPath
    """Target folder (config.json + safetensors, or an mlx-lm folder); relative to the config file."""
    trust_remote_code: bool = False
    """Accepted but not used: speculant never runs a checkpoint's own Python code."""


class QuantizationConfig(_Section):
    """In-memory draft quantization (weight bits, activation bits, group size)."""

    weight_bits: int | None = Field(None, ge=1, le=16)
    """Draft weight bits; unset = no quantization."""
    activation_bits: int = Field(16, ge=1, le=32)
    """Activation bits."""
    group_size: int = Field(64, ge=1, le=4096)
    """Weights sharing one scale."""
    quantize_all: bool = False
    """Also quantize what stays in float by default (DFlash2's selector projection and codebook
    tables, the convolution-kernel projections); spec suffix `:all`."""


class LookupConfig(_Section):
    """Prompt lookup: when the context's last ``min_match``..``max_match`` tokens occurred before,
    verify what followed them there instead of asking the drafter (``drafter.lookup = true``)."""

    enabled: bool = False
    """Verify prompt-lookup copies beside the drafter (`drafter.lookup = true` is short for this)."""
    min_match: int = Field(4, ge=1, le=MATCH_MAX)
    """Shortest suffix of the context that counts as a match."""
    max_match: int = Field(8, ge=1, le=MATCH_MAX)
    """Longest suffix of the context looked up (each token indexes every length up to it)."""


class DrafterConfig(_Section):
    """What proposes the tokens the target verifies; unset, the target decodes plainly."""

    kind: str | None = None
    """A registered drafter's name; unset or `none` = plain decoding."""
    path: LaxPath | None = None
    """Drafter checkpoint folder (`mtp` reads the target folder when unset); relative to the config
    file."""
    block_size: int | None = Field(None, ge=1, le=BLOCK_SIZE_MAX)
    """Runtime block (anchor + proposals), 2 .. the drafter's maximum; unset = its trained block."""
    quantization: QuantizationConfig | str | None = None
    """In-memory draft quantization: a spec like `w4a16:gs64` (`w<bits>[a<bits>][:gs<group>][:all]`,
    `off`) or a `[drafter.quantization]` table."""
    lookup: LookupConfig = Field(default_factory=LookupConfig)
    """Prompt lookup: `true` / `false`, or a `[drafter.lookup]` table."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The drafter's own options (`drafter.options` below); unknown keys are errors."""

    @field_validator("lookup", mode="before")
    @classmethod
    def _lookup_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @property
    def enabled(self) -> bool:
        return self.kind not in (None, "none", "")


class VerifierConfig(_Section):
    """What decides how many drafted tokens to keep."""

    kind: str = "auto"
    """`auto` (= `speculative_sampling`) or a registered verifier's name."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The verifier's own options (`verifier.options` below); unknown keys are errors."""

    @property
    def resolved_kind(self) -> str:
        """The registered verifier this ``kind`` names: ``auto`` is speculative_sampling (the exact
        greedy rule at temperature 0, the sampling rule otherwise)."""
        return "speculative_sampling" if self.kind == "auto" else self.kind


class SamplingConfig(_Section):
    """How the target's next token is chosen; speculation keeps this distribution exactly."""

    temperature: float = 0.0
    """0 = greedy; from 1e-4 on, sample from the target's logits divided by this."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities add up to this (1 = off)."""
    top_k: int = Field(0, le=TOP_K_MAX)
    """Keep only the k most likely tokens (0 = off)."""
    seed: int | None = Field(None, le=SEED_MAX)
    """Seed of the sampling and drafting random streams; unset = fresh each request. A seed repeats
    the text only with the same draft widths (`adaptive` changes them as it learns)."""


class GenerationConfig(_Section):
    """When a request stops."""

    max_new_tokens: int = Field(256, ge=1, le=CONTEXT_MAX)
    """Most tokens one request generates."""
    stop_token_ids: sequence_of(Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)], STOP_IDS_MAX) = Field(default_factory=list)
    """Extra token ids that end a request, besides the tokenizer's end of sequence (each inside the
    target's vocabulary)."""
    stop_strings: sequence_of(Annotated[str, Field(max_length=STOP_STRING_CHARS)], STOP_STRINGS_MAX) = Field(
        default_factory=list)
    """Text that ends a request; the text is cut before it (each at most 1024 characters)."""
    ignore_eos: bool = False
    """Keep going past end-of-sequence tokens (benchmarks)."""


PREFIX_BYTES_MAX = 2**50  # a petabyte: more than any machine holds


class PrefixCacheConfig(_Section):
    """Snapshots of earlier requests' caches, reused by a request whose prompt starts with the same
    tokens (a chat's earlier turns, an agent's system prompt): only the rest is prefilled."""

    max_bytes: int = Field(1 << 30, ge=0, le=PREFIX_BYTES_MAX)
    """Bytes the snapshots may hold together, on the target's device (least recently used evicted
    first; a snapshot larger than this is not kept); `0` turns the cache off."""
    disk_dir: LaxPath | None = None
    """A directory that snapshots evicted from memory are spilled to (safetensors, checked by a
    checksum when read back), and that later processes reuse; unset: none are kept on disk. Its
    files are JSON and safetensors, never pickle."""
    disk_max_bytes: int = Field(16 << 30, ge=0, le=PREFIX_BYTES_MAX)
    """Bytes the spilled snapshots' files may take in `disk_dir` (least recently used removed first)."""


class EngineConfig(_Section):
    """Everything an engine is built from; only `target.path` is required."""

    backend: BackendConfig = Field(default_factory=BackendConfig)
    """`[backend]`: the array runtime."""
    target: TargetConfig
    """`[target]`: the model to reproduce."""
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    """`[drafter]`: what proposes tokens."""
    verifier: VerifierConfig = Field(default_factory=VerifierConfig)
    """`[verifier]`: what keeps them."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """`[sampling]`: the target's decoding distribution."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """`[generation]`: when to stop."""
    prefix_cache: PrefixCacheConfig = Field(default_factory=PrefixCacheConfig)
    """`[prefix_cache]`: reuse of earlier requests' prefixes."""

    @classmethod
    def load(cls, source: "EngineConfig | dict | str | Path") -> "EngineConfig":
        """Build from a model, a dict, or a .toml / .yaml / .yml / .json file."""
        return load_model(cls, source, "an engine config", format_validation_error)

    def resolved_paths(self, base: Path) -> "EngineConfig":
        """Relative model paths in a config file are relative to that file."""
        data = self.model_copy(deep=True)
        if not data.target.path.is_absolute():
            data.target.path = base / data.target.path
        if data.drafter.path is not None and not data.drafter.path.is_absolute():
            data.drafter.path = base / data.drafter.path
        return data


def load_model(cls, source, what: str, format_errors):
    """A pydantic config model from itself, a dict or a file; paths in a file are resolved
    against its folder through ``cls.resolved_paths``."""
    if isinstance(source, cls):
        return source
    base = None
    if isinstance(source, (str, Path)):
        base = Path(source).resolve().parent
        source = read_config_file(source)
    if not isinstance(source, dict):
        raise ConfigError(f"{what} must be a table/mapping, got {type(source).__name__}")
    try:
        config = cls.model_validate(source)
    except ValidationError as exc:
        first = exc.errors()[0]["loc"] if exc.errors() else ()
        raise ConfigError(format_errors(exc), ".".join(map(str, first)) or None) from None
    return config.resolved_paths(base) if base else config


def read_config_file(path: str | Path) -> dict:
    """Parse a TOML, YAML or JSON file into a dict, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
            return {} if data is None else data
        if suffix == ".json":
            return json.loads(text)
    except Exception as exc:  # each parser raises its own type
        raise ConfigError(f"cannot parse {path} as {suffix[1:].upper()}: {exc}") from None
    raise ConfigError(f"unknown config format {suffix!r} for {path}: use .toml, .yaml, .yml or .json")


def format_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    lines = error_lines(exc, model or EngineConfig)
    return "invalid engine config:\n" + "\n".join(f"  - {line}" for line in lines)


_QUANT_BITS = (2, 4, 8)
_QUANT_ACT = (16, 32)
_QUANT_GROUPS = (32, 64, 128)


def parse_quantization(spec: "QuantizationConfig | str | None") -> QuantizationConfig | None:
    """Parse ``w4a16:gs64``-style specs (also ``w8``, ``w4:gs32``, ``w4:gs64:all``, ``off``)."""
    if spec is None or isinstance(spec, QuantizationConfig):
        return spec
    text = spec.strip().lower()
    if text in ("", "off", "none"):
        return None
    weight, *rest = text.split(":")
    quantize_all = rest[-1:] == ["all"]
    rest = rest[:-1] if quantize_all else rest
    try:
        if not weight.startswith("w") or len(rest) > 1 or (rest and not rest[0].startswith("gs")):
            raise ValueError
        wbits, _, abits = weight[1:].partition("a")
        gs = int(rest[0][2:]) if rest else 64
        numbers = {"weight_bits": int(wbits), "activation_bits": int(abits or 16), "group_size": gs}
    except ValueError:
        raise ConfigError(
            f"drafter.quantization: cannot parse {spec!r}; expected 'w<bits>[a<bits>][:gs<group>][:all]', e.g. 'w4a16:gs64'"
        ) from None
    try:
        return QuantizationConfig(**numbers, quantize_all=quantize_all)
    except ValidationError as exc:
        raise ConfigError(f"drafter.quantization: {spec!r}: {error_lines(exc, QuantizationConfig)[0]}") from None


QUANTIZATION_CHOICES = {"weight_bits": _QUANT_BITS, "activation_bits": _QUANT_ACT, "group_size": _QUANT_GROUPS}
