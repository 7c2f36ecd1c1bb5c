"""A transformers causal LM as a speculant TargetModel, with hidden-state capture and cache crop."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Iterator, Sequence

import torch

from speculant.backends.torch.compiled import CompiledSteps, CompileFailed, StaticKV, compile_problem, static_rows, wants_compile
from speculant.backends.torch.loading import logit_transform
from speculant.backends.torch.recorder import Recorder
from speculant.backends.torch import layouts, prefix
from speculant.backends.torch.strict import load_strict
from speculant.backends.torch.rollback import RollbackCache, install_recording, recording_into
from speculant.backends.torch.static_tree import attention_windows, commit_static_path, tree_inputs
from speculant.backends.torch.tree import commit_path, install_tree_conv, tree_mask, tree_nodes
from speculant.core.checkpoint import tokenizer_errors
from speculant.core.interfaces import TargetModel
from speculant.core.pre_tokenizer import restore_pre_tokenizer
from speculant.core.target_check import check_target_files
from speculant.core.tree import DraftTree
from speculant.core.types import Capture, ForwardOutput, TargetInfo


def decoder_parts(model) -> tuple[torch.nn.Module, torch.nn.ModuleList, torch.nn.Module]:
    """(inner model, decoder layers, final norm) for Llama/Qwen-style causal LMs."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(inner, "layers", None)
    norm = getattr(inner, "norm", None)
    if layers is None or norm is None:
        raise TypeError(f"{type(model).__name__} does not expose decoder layers and a final norm; unsupported family")
    return inner, layers, norm


def cache_keyword(model) -> str:
    """The forward's name for the KV cache: ``cache`` in newer transformers (which warn on the old
    ``past_key_values``), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TorchTarget(TargetModel):
    def __init__(self, model, tokenizer, info: TargetInfo, backend) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.backend = backend
        self._cache_cls = RollbackCache
        self.cache = RollbackCache(config=model.config)
        self._recorded_layers = install_recording(model)  # Gated DeltaNet layers whose states a rollback can reach
        install_tree_conv(model)  # their convolution over a draft tree's ancestors (tree.py)
        _, layers, norm = decoder_parts(model)
        self._recorder = Recorder(layers, norm)
        self._embedding = model.get_input_embeddings()
        self._head = model.get_output_embeddings()
        self._logit_transform = logit_transform(model.config)
        self._cache_kwarg = cache_keyword(model)
        self._static: StaticKV | None = None  # the compiled path's cache, see compiled.py
        self._steps: CompiledSteps | None = None
        self._on_static = False  # this request runs on the static cache
        self.layout: str | None = None  # the CPU's linear weights: "packed" (packed.py) or "transposed" (transposed.py)
        self._layout_note = ""  # what was done to them, or why nothing was (for a compiled fast_path)
        self._eager_reason = self._plan_fast_path(getattr(backend.config, "compile", "off"))
        self._tree: DraftTree | None = None  # the tree of the last forward_tree, until commit_tree

    def _plan_fast_path(self, setting: str) -> str:
        """Set up the compiled path where ``backend.compile`` asks for it and the target allows it,
        and on a CPU the linear weights' layout (layouts.py); otherwise say why the forwards stay eager."""
        device = self.model.device
        compiling = wants_compile(setting, device)
        problem = compile_problem(self.model, self.info.layer_types, self._recorded_layers) if compiling else None
        if setting != "off" and device.type == "cpu":
            self.layout, said = layouts.lay_out(self.model, self.backend.dtype,
                                                compiled=compiling and problem is None)
            self._head = self.model.get_output_embeddings()
            self._layout_note = said if self.layout else f"linear weights as loaded ({said})"
            if not compiling:
                return f"eager{'; ' if self.layout else ': '}{said} (backend.compile={setting} on cpu)"
        if not compiling:
            return f"eager: backend.compile is {setting!r}" + (f" (auto compiles on CUDA only, not {device.type})"
                                                               if setting == "auto" else "")
        if problem is not None:
            return f"eager: {problem}" + (f"; {self._layout_note}" if self._layout_note else "")
        rows, self._max_rows = static_rows(self.model.config, device)
        self._static = StaticKV(self.model.config, rows)
        self._steps = CompiledSteps(self._static_step, device)
        self._windows = attention_windows(self.model.config)  # the masks of a tree over the static cache
        return ""

    @property
    def fast_path(self) -> str:
        if self._steps is None:
            return self._eager_reason
        return self._steps.describe(self._static.rows) + (f"; {self._layout_note}" if self._layout_note else "")

    def warm_up(self, block_size: int, capture: Capture = Capture(), tree_sizes: Sequence[int] = ()) -> None:
        """Compile, now rather than inside the first requests, the graph of every width a block of
        ``block_size`` can use (widths 1 .. block_size, padded to powers of two) and of trees of
        exactly ``tree_sizes`` nodes (padding a tree costs what more nodes would) where the target
        takes trees; eager targets: nothing."""
        if self._steps is None:
            return
        tree_sizes = sorted(tree_sizes) if self.tree_problem() is None else []
        self.reset()
        if tree_sizes:  # a hybrid's record holds the widest tree before any graph compiles over it
            self._make_room(tree_sizes[-1] + 1)
        self.prefill([0], capture)
        for width in (1 << j for j in range(self._steps.padded_width(block_size).bit_length())):
            self.forward(self.backend.int_array([0] * width), capture)
            self.crop(1)
        self._steps.planned_trees.update(tree_sizes)
        for size in tree_sizes:
            self.reset()  # a hybrid's commit keeps no record to roll back to: each tree from a new prompt
            self.prefill([0], capture)
            self.forward_tree(DraftTree.chain([0] * size), capture)
            self.commit_tree(1, [0])
        self.reset()

    @classmethod
    def load(cls, path: str, info: TargetInfo, backend) -> "TorchTarget":
        check_target_files(path, info)  # damaged headers and non-float tensors, before any weights are read
        model, _loading = load_strict(path, backend.dtype)  # a damaged checkpoint stops here, naming tensors
        model.to(backend._device)
        return cls(model, load_tokenizer(path), info, backend)

    @property
    def cache_length(self) -> int:
        return self._static.length if self._on_static else int(self.cache.get_seq_length())

    def reset(self) -> None:
        self._on_static = self._steps is not None and self._steps.failure is None
        if self._on_static:
            self._static.restart()
        else:
            self.cache = self._cache_cls(config=self.model.config)

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, capture: Capture, logits_to_keep: int, **tree) -> ForwardOutput:
        self._recorder.start(capture)
        try:
            out = self.model(
                input_ids=ids[None, :],
                **{self._cache_kwarg: self.cache},
                use_cache=True,
                logits_to_keep=logits_to_keep,
                **tree,
            )
        except BaseException:  # e.g. Ctrl-C inside the forward: stop recording, keep the original error
            self._recorder.finish(Capture())
            raise
        features, final = self._recorder.finish(capture)
        return ForwardOutput(logits=out.logits[0], features=features, final_hidden=final)

    def _static_step(self, ids: torch.Tensor, capture: Capture, logits_to_keep: int = 0, **tree_inputs):
        """One forward over the static cache (``ids`` [1, k]; a tree's mask and positions): what a
        compiled graph runs."""
        self._recorder.start(capture)
        cache = {self._cache_kwarg: self._static.cache}
        out = self.model(input_ids=ids, **cache, use_cache=True, logits_to_keep=logits_to_keep, **tree_inputs)
        features, final = self._recorder.finish(capture)
        return out.logits[0], features, final

    @torch.inference_mode()
    def _run_static(self, ids: torch.Tensor, capture: Capture, compiled: bool, prompt: bool = False,
                    tree=None) -> ForwardOutput:
        """A forward over the static cache: a prompt chunk (eager, its last logits only), or a
        verify block / decode step, compiled or not, whose Gated DeltaNet states are recorded, or a
        draft tree (``tree(padded)``: its mask and positions, static_tree.py)."""
        static, width, start = self._static, int(ids.shape[0]), self._static.length
        recording = static.hybrid and not prompt
        if recording:
            static.cache.recording = True
        try:
            with recording_into(static.cache) if recording else contextlib.nullcontext():
                if compiled:
                    logits, features, final = self._steps(ids, capture, tree)
                else:
                    inputs = tree(width) if tree is not None else {}
                    logits, features, final = self._static_step(ids[None, :], capture, 1 if prompt else 0, **inputs)
        except CompileFailed:  # this request finishes eager over the static cache, later ones on a RollbackCache
            self._recorder.finish(Capture())
            static.set_length(start)  # the write position as before the failed call
            return self._run_static(ids, capture, compiled=False, prompt=prompt, tree=tree)
        except BaseException:  # e.g. Ctrl-C inside the forward: stop recording, keep the original error
            self._recorder.finish(Capture())
            raise
        finally:
            if recording:
                static.cache.recording = False
        # the write position after this block's own rows (a padded graph moved it past its padding)
        static.set_length(start + width)
        if prompt:
            static.recorded = (start + width, 0)  # a prompt chunk is never undone
        else:
            static.recorded_forward(start, self._steps.padded_width(width) if compiled else width, width)
        return ForwardOutput(logits=logits, features=features, final_hidden=final)

    def _make_room(self, width: int) -> None:
        """A forward of ``width`` rows fits the static cache and its Gated DeltaNet record, grown if not."""
        if not (self._static.fits(width) and self._static.records(width)):
            self._outgrown(width)

    def _outgrown(self, width: int) -> None:
        """The request outgrew the static cache: a cache twice as large (compiled anew) holds its
        rows, or, past the largest size, it continues eager on a RollbackCache of them."""
        rows = self._static.rows
        while rows < self._max_rows and self._static.length + width > rows:
            rows = min(2 * rows, self._max_rows)
        if self._static.length + width <= rows:
            widest = max(width, self._static.widest) if self._static.widest else None  # recorded forwards
            with torch.inference_mode():
                self._static = self._static.grown(self.model.config, rows, widest)
            self._steps.forget_graphs()
            return
        self.cache = self._cache_cls(config=self.model.config)
        with torch.inference_mode():
            self._static.copy_into(self.cache)
        self._on_static = False

    def prefill(self, token_ids: Sequence[int], capture: Capture = Capture()) -> ForwardOutput:
        ids = self.backend.int_array(token_ids)
        if self._on_static and not self._static.fits(len(ids)):
            self._outgrown(len(ids))
        if self._on_static:
            return self._run_static(ids, capture, compiled=False, prompt=True)  # prompt lengths vary: eager
        out = self._run(ids, capture, logits_to_keep=1)
        self.cache.rollback(0)  # sliding / convolution buffers back to what the next forward needs
        return out

    def forward(self, token_ids, capture: Capture = Capture()) -> ForwardOutput:
        """Verify a block: the cache keeps what a crop to any prefix of it needs (see rollback.py)."""
        if self._on_static:
            self._make_room(self._steps.padded_width(int(token_ids.shape[0])))
        if self._on_static:
            return self._run_static(token_ids, capture, compiled=self._steps.failure is None)
        with self.cache.verifying():
            self.cache.block_length += int(token_ids.shape[0])
            return self._run(token_ids, capture, logits_to_keep=0)

    def tree_problem(self) -> str | None:
        problem = type(self.backend).tree_problem(self.info)
        linear = [i for i, kind in enumerate(self.info.layer_types) if kind == "linear_attention"]
        if problem is None and not set(linear) <= self._recorded_layers:
            problem = f"linear_attention layers {sorted(set(linear) - self._recorded_layers)} run a delta rule speculant does not reach"
        return problem

    def forward_tree(self, tree: DraftTree, capture: Capture = Capture()) -> ForwardOutput:
        """Every node of ``tree`` in one forward (tree.py: positions, the ancestor-only mask; over
        the compiled path's static cache, static_tree.py)."""
        if self._on_static:
            self._make_room(tree.size if self._static.hybrid else self._steps.tree_width(tree.size))
        self._tree = tree
        if self._on_static:
            return self._static_tree(tree, capture)
        device = self.model.device
        mask = tree_mask(self.cache, tree, self.model.dtype, device)
        positions = torch.tensor([tree.positions(self.cache_length)], device=device)
        with self.cache.verifying(), tree_nodes(tree):
            self.cache.block_length += tree.size
            ids = self.backend.int_array(tree.tokens)
            return self._run(ids, capture, 0, attention_mask=mask, position_ids=positions)

    def _static_tree(self, tree: DraftTree, capture: Capture) -> ForwardOutput:
        static = self._static
        inputs = tree_inputs(self._windows, tree, static.length, static.rows, self.model.dtype, self.model.device)
        ids = self.backend.int_array(tree.tokens)
        if static.hybrid:  # each node's delta rule starts from its parent's state, read eagerly (rollback.py)
            with tree_nodes(tree):
                return self._run_static(ids, capture, compiled=False, tree=inputs)
        return self._run_static(ids, capture, compiled=self._steps.failure is None, tree=inputs)

    def commit_tree(self, length: int, path) -> None:
        tree, self._tree = self._tree, None
        if tree is None or self.cache_length != length + tree.size:
            raise RuntimeError(f"commit_tree({length}) must follow forward_tree over a cache of {length} positions")
        if self._on_static:
            commit_static_path(self._static, length, tree, path)
            return
        commit_path(self.cache, tree, path)

    def new_batch(self, layout: str = "padded"):
        from speculant.backends.torch.batch import TorchBatch
        from speculant.backends.torch.flat_batch import TorchFlatBatch

        layouts = {"padded": TorchBatch, "flat": TorchFlatBatch}
        if layout not in layouts:
            raise ValueError(f"batch layout {layout!r}: PyTorch batches as {' or '.join(map(repr, layouts))}")
        return layouts[layout](self)

    def greedy_steps(self, anchor_id: int) -> Iterator[int] | None:
        """Plain greedy decoding on the compiled path: the width-1 graph's argmax stays on the
        device and is fed back as the next input; the next step is queued before the host reads
        the current token (on CUDA the GPU then runs while the engine handles it). It runs one step
        ahead, so the cache holds one position more than was yielded until the engine crops it.
        None off the compiled path (the engine's own loop)."""
        if not (self._on_static and self._steps.failure is None):
            return None
        return self._greedy(anchor_id)

    @torch.inference_mode()
    def _greedy(self, anchor_id: int) -> Iterator[int]:
        pending = self._argmax_step(self.backend.int_array([anchor_id]))
        while True:
            ahead = self._argmax_step(pending)
            yield int(pending)
            pending = ahead

    def _argmax_step(self, token: torch.Tensor) -> torch.Tensor:
        return torch.argmax(self.forward(token).logits[-1:], dim=-1)

    def snapshot(self):
        """A copy of the eager or the static cache (prefix.py)."""
        if self._on_static:
            return prefix.snapshot_static(self._static)
        return prefix.snapshot_cache(self.cache, self.cache_length)

    def restore(self, snapshot, length: int) -> bool:
        """Each path restores its own snapshots only (a request after a failed compile runs cold)."""
        if self._on_static:
            if not self._static.fits(length):
                self._outgrown(length)
            return self._on_static and prefix.restore_static(self._static, snapshot, length)
        if not isinstance(snapshot.state, RollbackCache):
            return False
        self.cache = prefix.restored_cache(snapshot, length)  # outside inference mode, as reset() builds it
        return True

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Roll back to the first ``length`` positions (at most the last block); also trims the
        sliding-window and convolution buffers, so it follows every forward."""
        if self._on_static:
            self._static.crop(length)
            return
        self.cache.rollback(max(0, self.cache_length - length))

    @torch.inference_mode()
    def embed(self, token_ids, *, raw: bool = False) -> torch.Tensor:
        if raw:  # past the module's own scale or norm (Gemma, Muse Glimmer)
            return torch.nn.functional.embedding(token_ids, self._embedding.weight)
        return self._embedding(token_ids)

    def prepare_draft(self, module) -> str | None:
        if self.layout is None:
            return None
        return layouts.lay_out_like(module, self.layout, one_row_dense=layouts.dense_copies(self.model)[0] > 0)

    @torch.inference_mode()
    def lm_head(self, hidden, *, raw: bool = False) -> torch.Tensor:
        logits = self._head(hidden)
        return logits if raw or self._logit_transform is None else self._logit_transform(logits)


def load_tokenizer(path: str):
    """The folder's tokenizer, or None when it ships none (prompt_ids still work)."""
    folder = Path(path)
    if not any((folder / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    with tokenizer_errors(path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    restore_pre_tokenizer(tokenizer, folder)  # e.g. a Hub SmolLM2 folder's per-digit split
    return tokenizer
