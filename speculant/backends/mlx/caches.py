"""Target caches that roll back exactly to any accepted prefix of a verified block.

Speculative decoding verifies a block of ``w`` tokens in one forward and then keeps only the
first ``n`` of them (``1 <= n <= w``). mlx-lm's own caches cannot all give the other ``w - n``
back, so the target builds its cache from these instead (never re-running the target over the
accepted tokens):

- Full attention: mlx-lm's ``KVCache``; ``trim`` moves its offset back.
- Sliding-window attention: :class:`WindowKVCache` replaces ``RotatingKVCache``. It keeps rows in
  time order and drops old rows only *before* a block is appended, keeping the ``window - 1``
  rows the block's first query needs. Rolling back within the block therefore never needs a
  dropped row, and trimming is an offset move as for full attention. Memory: at most
  ``window - 1 + block`` rows (plus up to 256 rows of slack, as ``KVCache``); the attention
  of a one-token step reads ``window`` rows, as with ``RotatingKVCache``.
- Gated DeltaNet (``linear_attention``): :class:`DeltaCache` (an ``ArraysCache``) holds the
  short-convolution state (the last ``kernel - 1`` inputs) and the recurrent state
  ``[1, heads, v_dim, k_dim]`` (float32). During a verify forward (not prefill, not one-token
  steps) :func:`recording` makes the module-level ``gated_delta_update`` of the model's module
  run the block one token at a time through mlx-lm's own function, keeping the recurrent state
  after every position, and a :class:`ConvTap` keeps the convolution's input (previous conv
  state + the block's inputs). ``trim`` then installs the recurrent state at the accepted
  length and rebuilds the conv state from the last ``kernel - 1`` inputs of the accepted
  prefix. This is the vLLM / SGLang approach. Memory until the next forward: ``w`` recurrent
  states per linear layer (e.g. 16 x 32 x 128 x 128 x 4 B = 32 MiB per layer for a 16-token
  block on a Qwen3.5-9B-sized layer, 768 MiB over its 24 linear layers) plus ``kernel - 1 + w``
  conv rows. One token at a time is what mlx-lm's CPU path does anyway (bit-identical results);
  on Metal it is ``w`` kernel launches per linear layer instead of one. Measured on the CPU with
  a tiny hybrid (benchmarks/rollback_cost_mlx.py): recording + crop cost about 5 % of the verify
  forward (MLX's fixed cost of a few small ops per token and layer; the crop itself is < 1 %).

Outside a recording, the wrapped ``gated_delta_update`` delegates unchanged.
A pipelined plain decoder (``MLXTarget.greedy_steps``) runs one step ahead of what it has
handed out; before each one-token step ``DeltaCache.keep_step_undo`` keeps references to the
state, so ``trim(1)`` takes that step back (one step only: one state per layer is kept).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, _BaseCache

from speculant.backends.mlx.wrapper import Wrapper


class RollbackError(RuntimeError):
    """A cache was asked to give back rows it no longer has."""


class WindowKVCache(_BaseCache):
    """Sliding-window keys/values in time order that roll back like a full cache."""

    step = 256

    def __init__(self, window: int) -> None:
        self.window = int(window)
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0  # positions seen (absolute)
        self.start = 0  # absolute position of buffer row 0

    @property
    def _used(self) -> int:
        return self.offset - self.start

    def _kept(self) -> int:
        """Rows before the next block that its first query can still see."""
        return min(self._used, self.window - 1)

    def _make_room(self, keys: mx.array, values: mx.array) -> None:
        n, used = keys.shape[2], self._used
        if self.keys is not None and used + n <= self.keys.shape[2]:
            return
        keep = self._kept()
        size = (keep + n + self.step - 1) // self.step * self.step
        new_k = mx.zeros((*keys.shape[:2], size, keys.shape[3]), keys.dtype)
        new_v = mx.zeros((*values.shape[:2], size, values.shape[3]), values.dtype)
        if keep:
            new_k[..., :keep, :] = self.keys[..., used - keep:used, :]
            new_v[..., :keep, :] = self.values[..., used - keep:used, :]
        self.keys, self.values = new_k, new_v
        self.start = self.offset - keep

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._make_room(keys, values)
        used, n = self._used, keys.shape[2]
        lo = used - self._kept()
        self.keys[..., used:used + n, :] = keys
        self.values[..., used:used + n, :] = values
        self.offset += n
        return self.keys[..., lo:used + n, :], self.values[..., lo:used + n, :]

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        # The window is this cache's (the config's), whatever the model passes.
        kept = self._kept()
        if not return_array:
            if N == 1:
                return None
            if kept + N <= self.window:
                return "causal"
        return create_causal_mask(N, kept, window_size=self.window)

    def size(self) -> int:
        return min(self.offset, self.window)

    @property
    def state(self):
        used = self._used
        return self.keys[..., :used, :], self.values[..., :used, :]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        length = self.offset - n
        if self.start > 0 and length - (self.window - 1) < self.start:
            raise RollbackError(f"a sliding-window cache holding positions {self.start}..{self.offset - 1} cannot roll "
                                f"back to {length} (window {self.window})")
        self.offset = length
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class DeltaCache(ArraysCache):
    """``[conv_state, recurrent_state]`` of one Gated DeltaNet layer, plus what the last verify
    forward recorded to roll back to any prefix of its block."""

    def __init__(self, size: int = 2) -> None:
        super().__init__(size)
        self.conv_input: mx.array | None = None  # [rows, kernel - 1 + w, channels]
        self.states: list[mx.array] = []  # recurrent state after each block position
        self.initial: mx.array | None = None  # the recurrent state before the block
        self.before_step: list | None = None  # [conv, recurrent] before the last one-token step

    def forget(self) -> None:
        self.conv_input, self.states, self.initial, self.before_step = None, [], None, None

    def keep_step_undo(self) -> None:
        """Before a one-token step: keep the state (references, no copy) so ``trim(1)`` can take
        that step back, as a pipelined decoder needs after running one step ahead."""
        self.forget()
        self.before_step = [self[0], self[1]]

    @property
    def recorded(self) -> int:
        return len(self.states) if self.conv_input is not None else 0

    def is_trimmable(self) -> bool:
        return self.recorded > 0 or self.before_step is not None

    def trim(self, n: int) -> int:
        width = self.recorded
        if n <= 0:
            self.forget()
            return 0
        if n == 1 and width == 0 and self.before_step is not None:
            self[0], self[1] = self.before_step
            self.forget()
            return 1
        if width == 0:
            raise RollbackError("a Gated DeltaNet state can roll back only within the last verified block, and the "
                                "last forward recorded none (prefill or a one-token step)")
        if n >= width:
            raise RollbackError(f"a Gated DeltaNet state can roll back at most {width - 1} of the last verified "
                                f"block's {width} positions, not {n}")
        self.keep_rows([width - n] * self.conv_input.shape[0])
        return n

    def keep_rows(self, kept: list[int]) -> None:
        """Give row ``r`` its states after the first ``kept[r]`` positions of the recorded block
        (0: those before it): the recurrent state recorded there and the ``kernel - 1`` inputs
        up to there. A batch's rows each keep their own count (``batch.MLXBatch.crop``)."""
        window = self.conv_input.shape[1] - self.recorded  # kernel - 1
        states = [self.initial, *self.states]
        if len(kept) == 1:  # one sequence: slices, no copies
            self[0] = mx.contiguous(self.conv_input[:, kept[0]:kept[0] + window, :])
            self[1] = states[kept[0]]
        else:
            self[0] = mx.stack([self.conv_input[r, k:k + window] for r, k in enumerate(kept)])
            self[1] = mx.stack([states[k][r] for r, k in enumerate(kept)])
        self.forget()


def target_cache(model: nn.Module, window: int | None) -> list:
    """mlx-lm's cache for ``model`` with the rotating and array caches replaced by ours."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for i, c in enumerate(make_prompt_cache(model)):
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise NotImplementedError(f"layer {i}: a sliding-window cache keeping {c.keep} sink rows is not "
                                          "rolled back on MLX")
            caches.append(WindowKVCache(window or c.max_size))
        elif type(c) is ArraysCache:
            caches.append(DeltaCache(len(c.cache)))
        elif type(c) is KVCache:
            caches.append(c)
        else:
            raise NotImplementedError(f"layer {i}: mlx-lm's {type(c).__name__} cannot be rolled back on MLX")
    return caches


# -- recording a verify forward of Gated DeltaNet layers ---------------------------------------

class _Recording:
    """Where the taps put what one verify forward records; ``layer`` is the DeltaNet running."""

    def __init__(self, caches: list) -> None:
        self.caches = caches
        self.layer: int | None = None


_ACTIVE: list[_Recording] = []  # the recording in progress (at most one; forwards are not nested)


@contextmanager
def recording(caches: list) -> Iterator[None]:
    """Record per-position states into the ``DeltaCache`` entries of ``caches`` during one forward."""
    for c in caches:
        if isinstance(c, DeltaCache):
            c.forget()
    _ACTIVE.append(_Recording(caches))
    try:
        yield
    finally:
        _ACTIVE.pop()


def forget_all(caches: list) -> None:
    for c in caches:
        if isinstance(c, DeltaCache):
            c.forget()


class _Tree:
    """The draft tree a forward runs (``parents``, node order), set by ``tree.tree_forward``: the
    convolution then reads each node's ancestors and the delta rule starts from the parent's state."""

    parents: tuple[int, ...] | None = None
    conv = None  # tree.tree_conv, set with parents


TREE = _Tree()


class ConvTap(Wrapper):
    """Calls a DeltaNet's ``conv1d`` and, while recording, keeps its input for layer ``index``."""

    def __init__(self, conv: nn.Module, index: int) -> None:
        super().__init__(conv)
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        if _ACTIVE:
            rec = _ACTIVE[-1]
            rec.layer = self.index
            rec.caches[self.index].conv_input = x
        if TREE.parents is not None:
            return TREE.conv(self.module, x, TREE.parents)
        return self.module(x)


def _per_position(original):
    def gated_delta_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kwargs):
        rec = _ACTIVE[-1] if _ACTIVE else None
        if rec is None or rec.layer is None:
            return original(q, k, v, a, b, A_log, dt_bias, state, mask, **kwargs)
        cache, rec.layer = rec.caches[rec.layer], None
        ys, states, initial, parents = [], [], state, TREE.parents
        for t in range(q.shape[1]):
            step = slice(t, t + 1)
            if parents is not None:  # a tree node starts from its parent's state
                state = initial if parents[t] < 0 else states[parents[t]]
            y, state = original(q[:, step], k[:, step], v[:, step], a[:, step], b[:, step], A_log, dt_bias, state,
                                None if mask is None else mask[:, step], **kwargs)
            ys.append(y)
            states.append(state)
        cache.states, cache.initial = states, initial
        return mx.concatenate(ys, axis=1), state

    gated_delta_update.speculant_original = original
    return gated_delta_update


def delta_nets(layer: nn.Module) -> list[nn.Module]:
    """The Gated DeltaNet modules directly inside a decoder layer (mlx-lm names them ``linear_attn``)."""
    found = []
    for child in layer.children().values():
        if isinstance(child, nn.Module) and hasattr(child, "conv1d") and hasattr(child, "conv_kernel_size"):
            found.append(child)
    return found


def install_delta_taps(layers: list) -> list[int]:
    """Tap each DeltaNet's conv and wrap its module's ``gated_delta_update`` (once per module).
    Returns the indices of the layers that have one."""
    indices = []
    for i, layer in enumerate(layers):
        real = layer.get("module", layer) if hasattr(layer, "tap_key") else layer
        nets = delta_nets(real)
        if len(nets) > 1:
            raise NotImplementedError(f"layer {i} holds {len(nets)} Gated DeltaNet modules; one is supported")
        for net in nets:
            if not isinstance(net.conv1d, ConvTap):
                net.conv1d = ConvTap(net.conv1d, i)
            module = sys.modules[type(net).__module__]
            fn = getattr(module, "gated_delta_update", None)
            if fn is None:
                raise NotImplementedError(f"{module.__name__} calls no module-level gated_delta_update; its Gated "
                                          "DeltaNet states cannot be recorded per position")
            if not hasattr(fn, "speculant_original"):
                module.gated_delta_update = _per_position(fn)
            indices.append(i)
    return indices
