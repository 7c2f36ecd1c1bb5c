"""An mlx-lm model as a speculant TargetModel: hidden-state capture, KV cache, rollback.

The model is loaded by mlx-lm's own loader (plain and already-quantized folders alike). To
capture hidden states, each decoder layer of *this model instance* (and its final norm) is
replaced in its layer list by a thin :class:`Tap` module that calls the original and keeps
its output while a capture is active. No mlx-lm file or class is changed, every layer is
tapped, and each forward says which layers it wants, so any number of drafters with different
``target_layer_ids`` can share one target.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from speculant.backends.mlx import compiled, families, layout, prefix, split, static
from speculant.backends.mlx.caches import DeltaCache, forget_all, install_delta_taps, recording, target_cache
from speculant.backends.mlx.strict import checkpoint_errors
from speculant.backends.mlx.tree import attention_modules, commit_path, rope_problem, tree_forward
from speculant.backends.mlx.wrapper import Wrapper
from speculant.core.checkpoint import tokenizer_errors
from speculant.core.errors import NonFiniteLogitsError
from speculant.core.interfaces import TargetModel
from speculant.core.pre_tokenizer import restore_pre_tokenizer
from speculant.core.target_check import check_target_files
from speculant.core.tree import DraftTree
from speculant.core.types import Capture, ForwardOutput, TargetInfo

PREFILL_STEP = 512  # prompt rows per prefill chunk (bounds activation memory)
CLEAR_EVERY = 256  # pipelined plain steps between releases of MLX's buffer cache (as mlx-lm)


class Recorder:
    """What the taps of one target keep during one forward."""

    def __init__(self, last_layer: int) -> None:
        self.last_layer = last_layer
        self.wanted: frozenset = frozenset()
        self.got: dict[Any, mx.array] = {}

    def start(self, capture: Capture) -> None:
        wanted = set(capture.layer_ids)
        if capture.final_hidden == "post_norm":
            wanted.add("post_norm")
        elif capture.final_hidden == "pre_norm":
            wanted.add(self.last_layer)
        elif capture.final_hidden is not None:
            raise ValueError(f"Capture.final_hidden must be None, 'pre_norm' or 'post_norm', not {capture.final_hidden!r}")
        self.wanted = frozenset(wanted)
        self.got = {}

    def finish(self, capture: Capture, batched: bool = False) -> tuple[mx.array | None, mx.array | None]:
        """(features, final hidden) of the forward just run: of its one sequence ([rows, ...]), or,
        ``batched``, of every sequence in it ([batch, rows, ...])."""
        got, self.got, self.wanted = self.got, {}, frozenset()
        if batched:
            got = {key: value[None] for key, value in got.items()}  # so that [0] below keeps the batch
        features = None
        if capture.layer_ids:
            parts = [got[i][0] for i in capture.layer_ids]
            features = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        final = None
        if capture.final_hidden is not None:
            final = got["post_norm" if capture.final_hidden == "post_norm" else self.last_layer][0]
        return features, final


class Tap(Wrapper):
    """Calls ``module`` and hands its output to the recorder when ``key`` is wanted."""

    def __init__(self, module: nn.Module, key: Any, recorder: Recorder) -> None:
        super().__init__(module)
        self.tap_key = key
        self.recorder = recorder

    def __call__(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        if self.tap_key in self.recorder.wanted:
            self.recorder.got[self.tap_key] = out[0] if isinstance(out, tuple) else out
        return out


def text_model(model: nn.Module) -> nn.Module:
    """The module holding ``embed_tokens``, ``layers`` and ``norm`` (plain, nested or VLM-style)."""
    candidates = [model, getattr(model, "model", None), getattr(model, "language_model", None)]
    lm = getattr(model, "language_model", None)
    if lm is not None:
        candidates.append(getattr(lm, "model", None))
    for inner in candidates:
        if inner is not None and isinstance(getattr(inner, "layers", None), list) and hasattr(inner, "embed_tokens"):
            if hasattr(inner, "norm"):
                return inner
    raise TypeError(f"{type(model).__module__}.{type(model).__name__} exposes no embed_tokens / layers / norm; "
                    "this mlx-lm model family is not supported as a target")


def install_taps(model: nn.Module) -> Recorder:
    """Tap every decoder layer and the final norm of this model instance (once)."""
    inner = text_model(model)
    existing = getattr(inner, "_speculant_recorder", None)
    if existing is not None:
        return existing
    recorder = Recorder(len(inner.layers) - 1)
    for i, layer in enumerate(inner.layers):
        inner.layers[i] = Tap(layer, i, recorder)
    inner.norm = Tap(inner.norm, "post_norm", recorder)
    object.__setattr__(inner, "_speculant_recorder", recorder)
    return recorder


class MLXTarget(TargetModel):
    def __init__(self, model: nn.Module, tokenizer, info: TargetInfo, backend) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.backend = backend
        self._inner = text_model(model)
        self._recorder = install_taps(model)
        self._delta_layers = install_delta_taps(self._inner.layers)
        self._embed_transform = families.embed_transform(model, self._inner)
        self._logit_transform = families.logit_transform(model)
        self._length = 0
        self._tree: DraftTree | None = None  # the tree of the last forward_tree, until commit_tree
        self._static: static.StaticForward | None = None  # the whole forward compiled (static.py)
        self.cache = self._new_cache()
        setting = getattr(getattr(backend, "config", None), "compile", "auto")
        self.transposed = False  # float32 linear weights stored [in, out] for the CPU (layout.py)
        self.split_rows: int | None = None  # their products split over the cores from so many rows (split.py)
        weights = self._transpose_weights(setting)
        self._head = _output_head(model, self._inner)
        self._fast_path = compiled.apply(self._inner.layers, setting, backend.device, weights, self._compile_whole)
        if backend.device == "cpu" and getattr(backend, "blas", None):
            self._fast_path += f"; {backend.blas}"

    @classmethod
    def load(cls, path: str, info: TargetInfo, backend) -> "MLXTarget":
        check_target_files(path, info)  # damaged headers and non-float tensors, before any weights are read
        with checkpoint_errors(path):
            model = families.load(Path(path), info)
        if backend.dtype is not None:
            model.set_dtype(backend.dtype)
        mx.eval(model.parameters())
        return cls(model, load_tokenizer(path, info), info, backend)

    def _transpose_weights(self, setting: str) -> str | None:
        """The CPU's fast path unless ``backend.compile`` is off: linear weights stored transposed."""
        if setting == "off" or self.backend.device != "cpu":
            return None
        count, problem = layout.transpose_linears(self.model, measure=setting == "auto")
        if problem:
            return f"linear weights as loaded ({problem})"
        self.transposed = True
        tied = _output_head(self.model) is None and layout.transpose_tied_head(self._inner)
        note = f"{count} linear layers{' and the tied head' if tied else ''} stored transposed for the CPU's matmul"
        self.split_rows, split_note = split.split_linears(self.model, self._inner, measure=setting == "auto")
        return f"{note}; {split_note}" if split_note else note

    def prepare_draft(self, module) -> str | None:
        if not self.transposed:
            return None
        count, problem = layout.transpose_linears(module)
        if problem:
            return f"eager: {problem}"
        split_note = split.split_linears(module, split_rows=self.split_rows)[1] if self.split_rows else None
        return f"eager; {count} linear layers stored transposed" + (f"; {split_note}" if split_note else "")

    def _compile_whole(self) -> tuple[bool, str]:
        """Compile the whole forward over a static cache where the model allows it (static.py)."""
        forward, note = static.build(self.model, self.cache, self._recorder.start, self._recorder.finish)
        if forward is not None:
            self._static, self.cache = forward, forward.cache
        return forward is not None, note

    @property
    def fast_path(self) -> str:
        """What runs compiled and how (``compiled.apply``), and the traces made so far."""
        if self._static is None:
            return self._fast_path
        return f"{self._fast_path}; {self._static.describe()}"

    @property
    def compiles_whole(self) -> bool:
        """Whether the whole forward runs compiled (drafts follow: their step compiles too)."""
        return self._static is not None

    # -- cache -----------------------------------------------------------------------------
    def _new_cache(self) -> list:
        if self._static is not None:
            self._static.reset()
            return self._static.cache
        return target_cache(self.model, self.info.sliding_window)

    @property
    def cache_length(self) -> int:
        return self._length

    def reset(self) -> None:
        self.cache = self._new_cache()
        self._length = 0

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions; within the last forward's block (see caches.py)."""
        excess = self._length - length
        if excess > 0:
            for c in self.cache:
                c.trim(excess)
            self._length = length
        forget_all(self.cache)

    def snapshot(self):
        return prefix.snapshot_caches(self.cache, self._length)

    def restore(self, snapshot, length: int) -> bool:
        prefix.restore_caches(self.cache, snapshot, length)
        self._length = length
        forget_all(self.cache)
        return True

    # -- forwards --------------------------------------------------------------------------
    def _run(self, ids: mx.array, capture: Capture, compiled: bool = True,
             record: bool = False) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """``record``: keep the per-position Gated DeltaNet states a crop within this block needs."""
        if self._static is not None:  # prompt chunks (varying widths) run eagerly
            logits, features, final = self._static(ids[None], self._length, capture, compiled, record)
            self._length += int(ids.shape[0])
            return logits[0], features, final
        self._recorder.start(capture)
        try:
            with recording(self.cache) if record else nullcontext():
                logits = self.model(ids[None], cache=self.cache)
        except BaseException:
            self._recorder.start(Capture())  # stop recording; keep the original error
            raise
        features, final = self._recorder.finish(capture)
        self._length += int(ids.shape[0])
        return logits[0], features, final

    def prefill(self, token_ids: Sequence[int], capture: Capture = Capture()) -> ForwardOutput:
        """Chunks of the prompt without logits, then the last token alone for its logits."""
        ids = mx.array([int(t) for t in token_ids], dtype=mx.int32)
        n = int(ids.shape[0])
        features, finals = [], []
        for start in range(0, n - 1, PREFILL_STEP):
            _, f, h = self._run(ids[start:min(start + PREFILL_STEP, n - 1)], capture, compiled=False)
            features.append(f)
            finals.append(h)
            mx.eval([c.state for c in self.cache] + [a for a in (f, h) if a is not None])
        logits, f, h = self._run(ids[n - 1:], capture)
        features.append(f)
        finals.append(h)
        out = ForwardOutput(logits=logits, features=_join(features), final_hidden=_join(finals))
        _schedule(out)
        return out

    def forward(self, token_ids, capture: Capture = Capture()) -> ForwardOutput:
        record = bool(self._delta_layers) and int(token_ids.shape[0]) > 1
        if not record:
            forget_all(self.cache)  # a one-token step leaves nothing to roll back to
        logits, features, final = self._run(token_ids, capture, record=record)
        out = ForwardOutput(logits=logits, features=features, final_hidden=final)
        _schedule(out)
        return out

    # -- draft trees (tree.py) -------------------------------------------------------------
    def tree_problem(self) -> str | None:
        # the model's modules and cache kinds are fixed at load; walking them took 5 ms on SmolLM2,
        # and a batch asks at every join
        if not hasattr(self, "_tree_problem"):
            self._tree_problem = type(self.backend).tree_problem(self.info) or rope_problem(self.model, self.cache)
        return self._tree_problem

    def attentions(self) -> list:
        """The model's attention modules that hold a ``rope`` (tree.py swaps it during a tree forward)."""
        if not hasattr(self, "_attentions"):
            self._attentions = attention_modules(self.model)
        return self._attentions

    def forward_tree(self, tree: DraftTree, capture: Capture = Capture()) -> ForwardOutput:
        """Every node of ``tree`` in one forward: positions and masks from tree.py."""
        forget_all(self.cache)
        if self._static is not None:
            self._static.hold(tree.size)  # a ring holds window - 1 + the tree's rows
        ids = mx.array(list(tree.tokens), dtype=mx.int32)
        with tree_forward(self.attentions(), self.cache, tree):
            # eager over a static cache: a compiled trace would keep this tree's mask
            logits, features, final = self._run(ids, capture, compiled=False, record=bool(self._delta_layers))
        self._tree = tree
        out = ForwardOutput(logits=logits, features=features, final_hidden=final)
        _schedule(out)
        return out

    def commit_tree(self, length: int, path) -> None:
        tree, self._tree = self._tree, None
        if tree is None or self._length != length + tree.size:
            raise RuntimeError(f"commit_tree({length}) must follow forward_tree over a cache of {length} positions")
        commit_path(self.cache, length, tree, path)
        self._length = length + len(path)

    # -- pipelined plain greedy decoding ---------------------------------------------------
    def new_batch(self, layout: str = "padded"):
        from speculant.backends.mlx.batch import MLXBatch  # it imports this module

        if layout != "padded":
            raise ValueError(f"batch layout {layout!r}: MLX batches as 'padded' only")
        return MLXBatch(self)

    def greedy_steps(self, anchor_id: int) -> Iterator[int]:
        """Plain greedy tokens from ``anchor_id``, run as mlx-lm's ``generate_step`` runs them: the
        argmax stays on the device and is the next step's input, and that step is queued
        (``mx.async_eval``) before the host reads the current token. The cache therefore holds
        one position more than the tokens handed out; ``crop`` takes that step back, for every
        cache kind (a Gated DeltaNet layer keeps its state from before the step)."""
        forget_all(self.cache)
        token, top = self._step_ahead(mx.array([int(anchor_id)], dtype=mx.int32))
        mx.async_eval(token, top)
        steps = 0
        while True:
            next_token, next_top = self._step_ahead(token)
            mx.async_eval(next_token, next_top)
            best = top.item()
            if not math.isfinite(best):
                raise NonFiniteLogitsError(f"the target's logits at a plain decoding step {_non_finite(best)}; "
                                           "generation stopped. Check the checkpoint and the dtype (float16 "
                                           "overflows where bfloat16 or float32 does not).")
            yield int(token.item())
            steps += 1
            if steps % CLEAR_EVERY == 0:
                mx.clear_cache()
            token, top = next_token, next_top

    def _step_ahead(self, token: mx.array) -> tuple[mx.array, mx.array]:
        """One lazy decode step over ``token`` [1]: (its argmax [1] int32, the row's max logit)."""
        for c in self.cache:
            if isinstance(c, DeltaCache):
                c.keep_step_undo()
        if self._static is not None:
            logits = self._static(token[None], self._length, Capture())[0][0]
        else:
            logits = self.model(token[None], cache=self.cache)[0]
        self._length += 1
        return mx.argmax(logits, axis=-1).astype(mx.int32), mx.max(logits)

    # -- shared weights for drafters -------------------------------------------------------
    def embed(self, token_ids, *, raw: bool = False) -> mx.array:
        rows = self._inner.embed_tokens(token_ids)
        return rows if raw or self._embed_transform is None else self._embed_transform(rows)

    def lm_head(self, hidden, *, raw: bool = False) -> mx.array:
        logits = self._head(hidden)
        return logits if raw or self._logit_transform is None else self._logit_transform(logits)


def _output_head(model: nn.Module, inner: nn.Module | None = None):
    """The model's ``lm_head``; for tied embeddings ``inner.embed_tokens.as_linear``, or None
    when ``inner`` is not given."""
    for owner in (model, getattr(model, "language_model", None)):
        head = getattr(owner, "lm_head", None) if owner is not None else None
        if head is not None:
            return head
    return None if inner is None else inner.embed_tokens.as_linear


def _join(parts: list) -> mx.array | None:
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def _non_finite(value: float) -> str:
    if math.isnan(value):
        return "contain NaN"
    return "contain +inf" if value > 0 else "mask every token (all -inf)"


def _schedule(out: ForwardOutput) -> None:
    """Start computing the outputs now; the verifier's single host read then only waits."""
    mx.async_eval([a for a in (out.logits, out.features, out.final_hidden) if a is not None])


def load_tokenizer(path: str, info: TargetInfo):
    """mlx-lm's tokenizer wrapper for the folder, or None when it ships no tokenizer."""
    folder = Path(path)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    with tokenizer_errors(path):
        tokenizer = mlx_load_tokenizer(folder, eos_token_ids=list(info.eos_token_ids) or None)
    restore_pre_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer), folder)  # e.g. a Hub SmolLM2 folder's per-digit split
    return tokenizer
