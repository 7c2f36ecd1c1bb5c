"""The compiled fast path of a PyTorch target: a preallocated KV cache and one ``torch.compile``d
graph per forward width.

On a small target a forward is dominated by per-operator overhead (Python, dispatch, kernel
launches), not arithmetic. A compiled graph removes most of it, but only for fixed shapes, so:

- **Static cache.** transformers' ``StaticCache`` holds ``capacity`` rows per layer from the start.
  Every layer's write position (``cumulative_length``, a tensor at a fixed address) says where the
  next forward writes; rows after a query's position are masked by the causal mask, so a rollback
  (``crop``) only moves that position back and the rejected rows are overwritten by the next
  forward. A new request starts at position 0 over the same buffers.
- **One graph per width bucket.** A one-token decode step and a verify block are graphs of their
  own (``dynamic=False``), compiled the first time a width is used and then reused by every later
  request of the engine. Widths are padded up to a power of two (a block of 5 runs the 8-token
  graph): the verifiers use every width from 1 to the block (the adaptive one by choice, all of
  them at the end of a request), and a graph per width would cost a compile each (20-130 s on
  this CPU) and, on CUDA, a graph pool each. The padding rows are written after the block's own
  rows, where the next forward overwrites them and the causal mask hides them until then; their
  logits are dropped. Each bucket's function gets a code object of its own, so
  dynamo's per-code cache holds exactly one entry per graph: a second entry is a recompilation,
  which :attr:`CompiledSteps.recompiles` counts (tests assert it stays 0).
- **Capture.** The forward hooks that keep the requested layers' outputs (``recorder.Recorder``)
  run inside the graph; the graph returns them as outputs, so DFlash / DFlash2 / MTP get the same
  features as from the eager forward (up to float rounding of the fused kernels).
- **Prefill** stays eager (its length varies), writing into the same static cache.
- **Growth and overflow.** On a CPU the cache starts small (see ``CPU_STATIC_ROWS``) and a
  request that outgrows it moves to one twice as large, compiled anew (once per size for the
  engine's life). Past the largest size (the context window, at most ``MAX_STATIC_ROWS``) the
  request moves its rows into an eager :class:`RollbackCache` and finishes there; the next request
  is back on the fast path.

Draft trees (the ``tree`` verifier) run over the same static cache through graphs of their own,
taking the tree's mask and positions as inputs (``static_tree.py``), one per tree budget of
exactly its node count (a padding row costs what a node does), compiled at load.

On CUDA the graphs are captured as CUDA graphs (``mode="reduce-overhead"``): the static cache
keeps every address fixed, and outputs are cloned because a replay reuses their memory. This is
untested here (no GPU was available when it was written).

Sliding-window layers are compiled over a static cache laid out as full attention
(:func:`full_attention_cache_config`): every row is kept at its position, so a rollback still only
moves the write position, and the model masks each sliding layer over those positions itself. A
long request attends over more rows than the window, masked; on a GPU that is cheap next to the
launches saved.

Gated DeltaNet layers (Qwen3.5, Qwen3-Next) keep their conv and recurrent states in the static
cache too; the forward also records them before and after each of its positions, and a crop puts
back those after the accepted ones (``recording_static.py``). A padded graph's padding rows pass
through the recurrence, so their effect is taken back right after the forward.

Not compiled (the target stays on the eager RollbackCache path, and ``fast_path`` says why): other
layer kinds, linear-attention layers whose delta rule ``rollback.install_recording`` does not
reach, and any target whose compilation fails.
"""

from __future__ import annotations

import time
import types
from typing import Callable

import torch
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from speculant.backends.torch.rollback import ROLLBACK

# Where ``backend.compile = "auto"`` compiles. Measured on the shipped 5M-parameter pair on the
# project's shared 2-core CPU (benchmarks/compile_torch.py --threads 1, bf16, 96 new tokens, medians
# of 5 interleaved repeats, 2026-12-02): compiled plain decoding ran 1.35x eager plain (1.43x through
# greedy_steps), compiled DFlash 1.31x eager DFlash, but compiling cost 23 s for width 1 and 101 s
# for widths 1-8 (64-339 s when the machine was busier). That pays only after minutes of decoding
# (a server), not for a one-shot generation or a test run, so on a CPU "auto" stays eager and
# "on" is the choice for long-lived engines. "auto" compiles where launches dominate a small
# model's forward and CUDA graphs remove them: CUDA (not measured here; no GPU was available).
AUTO_DEVICES = ("cuda",)
COMPILED_LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")
# Rows preallocated per layer: at most the target's context window and MAX_STATIC_ROWS (a request
# that grows past that finishes on the eager path). Every step attends over all rows, masked, which
# on a CPU costs more than the compiled graph saves once the rows far outnumber the used ones: a
# width-1 step of the shipped pair ran 1.9x the eager one over 256 rows, 0.8x over 2048 (bf16).
# So on a CPU the cache starts at CPU_STATIC_ROWS and doubles when a request outgrows it
# (recompiling the widths once per size, for the engine's life); elsewhere it starts full size.
MAX_STATIC_ROWS = 4096
CPU_STATIC_ROWS = 256


def compile_problem(model: torch.nn.Module, layer_types, recorded: set[int]) -> str | None:
    """Why ``model``'s forwards cannot run compiled over a static cache, or None. ``recorded``: the
    linear-attention layers whose per-position states ``rollback.install_recording`` reaches."""
    layer_types = list(layer_types or ("full_attention",))
    kinds = sorted(set(layer_types) - set(COMPILED_LAYER_KINDS))
    if kinds:
        what = ", ".join(f"{kind} layers" for kind in kinds)
        return f"{what} are not compiled: their rollback needs the eager RollbackCache"
    unreached = [i for i, kind in enumerate(layer_types) if kind == "linear_attention" and i not in recorded]
    if unreached:
        return (f"linear_attention layers {unreached} are not compiled: their delta rule is not one whose "
                "per-position states speculant records")
    try:
        cache_class(layer_types)(config=full_attention_cache_config(model.config), max_cache_len=8)
    except Exception as exc:  # a config transformers builds no static cache for
        return f"transformers builds no static cache for {type(model).__name__}: {exc}"
    return None


def cache_class(layer_types) -> type:
    """transformers' StaticCache, or, with Gated DeltaNet layers, one that records their states."""
    if "linear_attention" in (layer_types or ()):
        from speculant.backends.torch.recording_static import RecordingStaticCache

        return RecordingStaticCache
    from transformers import StaticCache

    return StaticCache


def wants_compile(setting: str, device: torch.device) -> bool:
    return setting == "on" or (setting == "auto" and device.type in AUTO_DEVICES)


def static_rows(config, device: torch.device) -> tuple[int, int]:
    """(first, largest) static cache rows for ``config`` on ``device``."""
    window = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    largest = min(int(window), MAX_STATIC_ROWS) if window else MAX_STATIC_ROWS
    return (min(CPU_STATIC_ROWS, largest) if device.type == "cpu" else largest), largest


def full_attention_cache_config(config):
    """``config``'s text config with every layer a full-attention one, for the static cache only.

    transformers gives a sliding layer a static ring of ``window`` rows, which a rollback cannot
    move back over. Kept whole instead, row == position like a full layer's, it rolls back by
    moving the write position; the model still builds each sliding layer's mask from its own
    config, over those absolute positions, so every layer sees what it would eagerly."""
    import copy

    text = copy.copy(config.get_text_config(decoder=True))
    if getattr(text, "layer_types", None):
        text.layer_types = ["linear_attention" if kind == "linear_attention" else "full_attention"
                            for kind in text.layer_types]
    text.sliding_window = None
    return text


class StaticKV:
    """transformers' StaticCache with a host-side length and a rollback that only moves the write
    position, and for Gated DeltaNet layers puts back their recorded states (recording_static.py)."""

    def __init__(self, config, rows: int, widest: int | None = None) -> None:
        from speculant.backends.torch.recording_static import RECORDED_WIDTH

        layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None)
        self.hybrid = "linear_attention" in (layer_types or ())  # Gated DeltaNet layers: states recorded
        self.widest = (widest or RECORDED_WIDTH) if self.hybrid else None
        extra = {"widest": self.widest} if self.hybrid else {}
        self.cache = cache_class(layer_types)(config=full_attention_cache_config(config), max_cache_len=rows, **extra)
        self.rows = rows
        self.length = 0
        # (start, padded width) of the last forward whose Gated DeltaNet states are recorded; after a
        # prompt chunk (its end, 0): a crop never goes back past it
        self.recorded: tuple[int, int] | None = None

    @torch.inference_mode()
    def set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.fill_(length)  # in place: the graphs read it at a fixed address
        set_linear_lengths(self.cache, length)
        self.length = length

    @torch.inference_mode()
    def restart(self) -> None:
        """Position 0 for a new request: old rows are masked, then overwritten; recurrent states zeroed."""
        self.set_length(0)
        self.recorded = None
        if self.hybrid:
            self.cache.restart()

    def fits(self, width: int) -> bool:
        return self.length + width <= self.rows

    def records(self, width: int) -> bool:
        """Whether a forward of ``width`` rows fits the Gated DeltaNet record (no such layers: always)."""
        return self.widest is None or width <= self.widest

    def recorded_forward(self, start: int, padded: int, width: int) -> None:
        """A forward of ``width`` tokens (run as ``padded``) wrote rows from ``start``: its padding's
        effect on the recurrent states is taken back at once."""
        self.recorded = (start, padded)
        if self.hybrid and width < padded:
            self.cache.roll_back_to(width)

    @torch.inference_mode()
    def crop(self, length: int) -> None:
        """Roll back to ``length`` positions, at most the last recorded forward's with Gated DeltaNet layers."""
        length = min(length, self.length)
        if self.hybrid and length < self.length:
            start, padded = self.recorded or (self.length, 0)
            if length < start:
                raise RuntimeError(f"cannot roll back to {length} positions: the Gated DeltaNet states are "
                                   f"recorded for the last forward only, from position {start}")
            if not ROLLBACK.keep_whole_block:
                self.cache.roll_back_to(length - start)
        self.set_length(length)

    def grown(self, config, rows: int, widest: int | None = None) -> "StaticKV":
        """A larger static cache (or one recording wider forwards) holding this one's rows."""
        bigger = StaticKV(config, rows, widest or self.widest)
        self.copy_into(bigger.cache)
        bigger.length = self.length
        bigger.recorded = (self.length, 0)  # the new cache holds no record: nothing before this is undone
        return bigger

    def copy_into(self, cache) -> None:
        """Append this cache's first ``length`` rows, and its linear layers' states, to an empty
        (dynamic or static) ``cache``."""
        for index, layer in enumerate(self.cache.layers if self.length else ()):
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                cache.update_conv_state(layer.conv_states[0].clone(), index, conv_kernel_size=layer.conv_states[0].shape[-1])
                cache.update_recurrent_state(layer.recurrent_states[0].clone(), index)
                continue
            keys, values = layer.keys[:, :, : self.length], layer.values[:, :, : self.length]
            cache.update(keys.clone(), values.clone(), index)
        set_linear_lengths(cache, self.length)  # the conv states alone would count ``kernel`` positions


def set_linear_lengths(cache, length: int) -> None:
    """Set the position count of every linear-attention layer, in place. transformers >= 5.25
    keeps one per layer and takes the model's positions from it when the first layer is linear
    (Qwen3.5), so it must follow the attention layers' through a rollback."""
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length_linear", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)


class CompileFailed(RuntimeError):
    """A width's graph could not be compiled (the reason is in ``CompiledSteps.failure``)."""


class CompiledSteps:
    """``torch.compile``d forwards over a :class:`StaticKV`, one per (width, capture), built lazily."""

    def __init__(self, step: Callable, device: torch.device) -> None:
        self._step = step  # step(ids [1, k], capture, **tree_inputs) -> (logits, features, final): the eager forward
        self._graphs: dict[tuple, Callable] = {}
        self._codes: list[types.CodeType] = []
        self.widths: set[int] = set()
        self.tree_widths: set[int] = set()
        self.planned_trees: set[int] = set()  # node counts whose tree graphs run exactly that many rows
        self.compile_s = 0.0
        self.failure: str | None = None
        self._cuda = device.type == "cuda"
        self._options = {"mode": "reduce-overhead"} if self._cuda else {}

    def forget_graphs(self) -> None:
        """Drop every graph (the cache they were compiled over was replaced); later calls compile anew."""
        self._graphs.clear()
        self._codes.clear()
        self.widths.clear()
        self.tree_widths.clear()

    @staticmethod
    def padded_width(width: int) -> int:
        return 1 << (width - 1).bit_length()

    def tree_width(self, nodes: int) -> int:
        """The rows a tree of ``nodes`` runs as: the narrowest planned or compiled tree graph that
        holds it (a tree cut short at a request's end runs its budget's graph rather than compiling
        one), else a new one of the next power of two."""
        widths = self.tree_widths | self.planned_trees
        return min((w for w in widths if w >= nodes), default=self.padded_width(nodes))

    def __call__(self, ids: torch.Tensor, capture, tree_inputs: Callable[[int], dict] | None = None):
        """The forward of ``ids`` through its width's graph. ``tree_inputs(padded)``: a draft tree's
        mask and positions for that many rows (static_tree.py), run by graphs of their own."""
        width = int(ids.shape[0])
        padded = self.padded_width(width) if tree_inputs is None else self.tree_width(width)
        # padding: any token id will do, its rows are never read. Always a new tensor made here,
        # under inference mode, so that every call's input has the same dispatch keys (a tensor
        # made outside inference mode would fail the graph's guards and recompile it)
        ids = torch.cat([ids, ids[-1:].expand(padded - width)])
        args = (ids[None, :],) if tree_inputs is None else (ids[None, :], tree_inputs(padded))
        key = (padded, capture, tree_inputs is not None)
        graph = self._graphs.get(key)
        out = self._first_call(key, args, capture) if graph is None else graph(*args)
        return tuple(None if x is None else (x[:width].clone() if self._cuda else x[:width]) for x in out)

    def _first_call(self, key, args, capture):
        """Compile the width's graph (the first call traces and compiles), timed."""
        step = self._step

        def run(batch, tree_inputs=None):
            return step(batch, capture, **(tree_inputs or {}))

        # a code object of its own: dynamo caches per code object, so widths never share an entry
        name = f"{'tree' if key[2] else 'width'}_{key[0]}"
        run = types.FunctionType(run.__code__.replace(), run.__globals__, name, run.__defaults__, run.__closure__)
        graph = torch.compile(run, fullgraph=True, dynamic=False, **self._options)
        started = time.perf_counter()
        try:
            out = graph(*args)
        except Exception as exc:  # dynamo / inductor refused the forward: nothing of it ran
            self.failure = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            raise CompileFailed(self.failure) from exc
        finally:
            self.compile_s += time.perf_counter() - started
        self._graphs[key] = graph
        self._codes.append(run.__code__)
        (self.tree_widths if key[2] else self.widths).add(key[0])
        return out

    @property
    def recompiles(self) -> int:
        """Cache entries beyond one per compiled graph (a graph dynamo had to build again)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return sum(max(0, len(_debug_get_cache_entry_list(code)) - 1) for code in self._codes)

    def describe(self, rows: int) -> str:
        if self.failure is not None:
            return f"eager: compiling failed ({self.failure})"
        widths = ", ".join(str(w) for w in sorted(self.widths)) or "none yet"
        trees = ", ".join(str(w) for w in sorted(self.tree_widths))
        trees = f"; trees {trees}" if trees else ""
        return f"compiled: widths {widths}{trees}; static cache {rows}; compile {self.compile_s:.1f} s"
