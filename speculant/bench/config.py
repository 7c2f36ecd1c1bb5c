"""The benchmark configuration: what to measure (the matrix) and how (repeats, warm-up, output).

A ``bench.toml`` looks like::

    target = "models/qwen3-4b"          # or [[targets]] tables with path/name
    draft = "models/qwen3-4b-dflash"    # default checkpoint for drafters that give no path
    out = "bench-out/qwen3-4b"
    repeats = 3
    warmup = 1

    [matrix]
    drafters = ["none", "dflash", { kind = "dflash2", path = "models/qwen3-4b-dflash2" }]
    block_sizes = [3, 5, 8]
    sampling = ["greedy", { temperature = 1.0, top_p = 0.95, top_k = 20 }]
    context_lengths = [0, "4k", "8k"]     # tokens, "4k", or "25%" of the model's window
    max_new_tokens = [256]
    workloads = ["code", "prompts/math.jsonl"]

Unknown keys are errors naming the field path, like the engine config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speculant.bench.workloads import BUILTIN_WORKLOADS, parse_context_length
from speculant.core.config import load_model
from speculant.core.errors import ConfigError


TARGET_FOLDER_DRAFTERS = ("mtp",)  # read their weights from the target folder when given no path


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TargetPoint(_Model):
    path: Path
    name: str | None = None

    @property
    def label(self) -> str:
        return self.name or self.path.name


class BackendPoint(_Model):
    kind: str = "torch"
    device: str = "auto"
    dtype: str = "auto"

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.device}" + ("" if self.dtype == "auto" else f":{self.dtype}")


class DrafterPoint(_Model):
    kind: str = "dflash"  # "none" = plain decoding only
    path: Path | None = None  # None: the top-level ``draft`` (drafters that need a checkpoint)
    options: dict[str, Any] = Field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.kind not in ("none", "")


class SamplingPoint(_Model):
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def label(self) -> str:
        if self.is_greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"]
        if self.top_p < 1:
            parts.append(f"p={self.top_p:g}")
        if self.top_k:
            parts.append(f"k={self.top_k}")
        return " ".join(parts)


class WorkloadSpec(_Model):
    """A named prompt set: a built-in name (``code``, ``math``, ``chat``) or a prompt file."""

    name: str
    path: Path | None = None
    prompts: list[str] | None = None  # inline prompts
    chat_template: bool | None = None  # None: apply the tokenizer's chat template when it has one


class MatrixConfig(_Model):
    drafters: list[DrafterPoint] = Field(default_factory=lambda: [DrafterPoint(kind="none"), DrafterPoint()])
    block_sizes: list[int | None] = Field(default_factory=lambda: [None])  # None = the draft's trained block
    verifiers: list[str] = Field(default_factory=lambda: ["auto"])
    tree_budgets: list[int] = Field(default_factory=lambda: [16])  # `tree` verifier cells only: nodes B
    tree_widths: list[int] = Field(default_factory=lambda: [8])  # `tree` verifier cells only: candidates K
    quantization: list[str] = Field(default_factory=lambda: ["off"])  # "off", "w4", "w8:gs32", ...
    backends: list[BackendPoint] = Field(default_factory=lambda: [BackendPoint()])
    sampling: list[SamplingPoint] = Field(default_factory=lambda: [SamplingPoint()])
    context_lengths: list[int | str] = Field(default_factory=lambda: [0])
    max_new_tokens: list[int] = Field(default_factory=lambda: [256])
    workloads: list[WorkloadSpec] = Field(default_factory=lambda: [WorkloadSpec(name="code")])

    @field_validator("drafters", mode="before")
    @classmethod
    def _drafters(cls, v: Any) -> Any:
        return [{"kind": d} if isinstance(d, str) else d for d in _as_list(v)]

    @field_validator("backends", mode="before")
    @classmethod
    def _backends(cls, v: Any) -> Any:
        return [_parse_backend(b) if isinstance(b, str) else b for b in _as_list(v)]

    @field_validator("sampling", mode="before")
    @classmethod
    def _sampling(cls, v: Any) -> Any:
        return [_parse_sampling(s) if isinstance(s, str) else s for s in _as_list(v)]

    @field_validator("workloads", mode="before")
    @classmethod
    def _workloads(cls, v: Any) -> Any:
        return [_parse_workload(w) if isinstance(w, str) else w for w in _as_list(v)]

    @field_validator("block_sizes", "verifiers", "quantization", "context_lengths", "max_new_tokens", "tree_budgets",
                     "tree_widths", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return _as_list(v)

    @field_validator("block_sizes")
    @classmethod
    def _blocks(cls, v: list[int | None]) -> list[int | None]:
        if any(b is not None and b < 2 for b in v):
            raise ValueError("block sizes count the anchor plus proposals: use 2 or more")
        return v

    @field_validator("tree_budgets", "tree_widths")
    @classmethod
    def _tree_axes(cls, v: list[int]) -> list[int]:
        if any(not 1 <= n <= 1024 for n in v):
            raise ValueError("tree budgets and widths are counts from 1 to 1024 (options of the tree verifier)")
        return v

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v: list[int]) -> list[int]:
        if any(n < 2 for n in v):
            raise ValueError("use at least 2 new tokens (decode speed needs tokens after the first)")
        return v

    @field_validator("context_lengths")
    @classmethod
    def _contexts(cls, v: list[int | str]) -> list[int | str]:
        for item in v:
            parse_context_length(item)  # raises ValueError with the accepted forms
        return v

    @model_validator(mode="after")
    def _non_empty(self) -> "MatrixConfig":
        for name in type(self).model_fields:
            if not getattr(self, name):
                raise ValueError(f"matrix.{name} is empty: give at least one value")
        return self


class BenchConfig(_Model):
    targets: list[TargetPoint] = Field(default_factory=list)
    # The checkpoint for drafters that give no path: one folder, or a table by drafter kind.
    # A single folder is not given to MTP, whose heads live in the target folder by default.
    draft: Path | dict[str, Path] | None = None
    matrix: MatrixConfig = Field(default_factory=MatrixConfig)
    out: Path = Path("bench-out/latest")
    repeats: int = Field(3, ge=1)
    warmup: int = Field(1, ge=0)
    warmup_tokens: int = Field(16, ge=2)
    prompts_per_workload: int | None = Field(4, ge=1)
    seed: int = 0
    ignore_eos: bool = True  # fixed output lengths, so plain and speculative runs do equal work
    threads: int | None = Field(None, ge=1)  # torch intra-op threads; None = leave as is
    context_fit: Literal["scale", "skip"] = "scale"
    reference: bool = False  # add the reference dflash loop and transformers columns
    record_tokens: bool = False  # store output token ids in runs.jsonl (hashes always)
    plots: bool = True

    @model_validator(mode="before")
    @classmethod
    def _target_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "target" in data:
            data = dict(data)
            target = data.pop("target")
            if target is not None:
                if data.get("targets"):
                    raise ValueError("give either target or targets, not both")
                data["targets"] = [target]
        if isinstance(data, dict) and "targets" in data:
            data["targets"] = [{"path": t} if isinstance(t, (str, Path)) else t for t in _as_list(data["targets"])]
        return data

    @classmethod
    def load(cls, source: "BenchConfig | dict | str | Path") -> "BenchConfig":
        """Build from a model, a dict, or a .toml / .yaml / .json file (paths relative to it)."""
        return load_model(cls, source, "a bench config", format_errors)

    def resolved_paths(self, base: Path) -> "BenchConfig":
        def fix(p: Path | None) -> Path | None:
            return p if p is None or p.is_absolute() else base / p

        matrix = self.matrix.model_copy(update={
            "drafters": [d.model_copy(update={"path": fix(d.path)}) for d in self.matrix.drafters],
            "workloads": [w.model_copy(update={"path": fix(w.path)}) for w in self.matrix.workloads],
        })
        draft = {k: fix(v) for k, v in self.draft.items()} if isinstance(self.draft, dict) else fix(self.draft)
        return self.model_copy(update={
            "targets": [t.model_copy(update={"path": fix(t.path)}) for t in self.targets],
            "draft": draft, "out": fix(self.out), "matrix": matrix,
        })

    def with_updates(self, **fields: Any) -> "BenchConfig":
        """A validated copy with top-level fields (and ``matrix`` as a dict of axes) replaced."""
        data = self.model_dump()
        matrix = fields.pop("matrix", None) or {}
        data.update(fields)
        data["matrix"].update(matrix)
        try:
            return type(self).model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc)) from None

    def drafter_path(self, drafter: DrafterPoint) -> Path | None:
        if drafter.path is not None or not drafter.enabled:
            return drafter.path
        if isinstance(self.draft, dict):
            return self.draft.get(drafter.kind)
        return None if drafter.kind in TARGET_FOLDER_DRAFTERS else self.draft


def format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(root)"
        msg = "unknown key (check the spelling)" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"  - {field}: {msg}")
    return "invalid bench config:\n" + "\n".join(lines)


def _as_list(v: Any) -> Any:
    return v if isinstance(v, (list, tuple)) else [v]


def _parse_backend(text: str) -> dict:
    """``torch``, ``torch:cpu`` or ``torch:cuda:bfloat16``."""
    parts = text.split(":")
    if parts[0] == "torch" and len(parts) >= 3 and parts[2].isdigit():  # torch:cuda:1[:dtype]
        parts = [parts[0], f"{parts[1]}:{parts[2]}", *parts[3:]]
    keys = ("kind", "device", "dtype")
    if len(parts) > 3:
        raise ValueError(f"cannot parse backend {text!r}; use kind[:device[:dtype]], e.g. torch:cpu:float32")
    return dict(zip(keys, parts))


def _parse_sampling(text: str) -> dict:
    """``greedy`` or ``T=0.7,p=0.95,k=20`` (also temperature=, top_p=, top_k=)."""
    if text.strip().lower() in ("greedy", "t=0", "0"):
        return {}
    names = {"t": "temperature", "temperature": "temperature", "p": "top_p", "top_p": "top_p",
             "k": "top_k", "top_k": "top_k"}
    out: dict[str, float | int] = {}
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        if key.lower() not in names or not value:
            raise ValueError(f"cannot parse sampling {text!r}; use 'greedy' or 'T=0.7,p=0.95,k=20'")
        field = names[key.lower()]
        out[field] = int(value) if field == "top_k" else float(value)
    return out


def _parse_workload(text: str) -> dict:
    if text in BUILTIN_WORKLOADS:
        return {"name": text}
    path = Path(text)
    return {"name": path.stem, "path": path}
