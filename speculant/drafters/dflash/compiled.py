"""The DFlash (and DFlash2) draft step on PyTorch as one ``torch.compile``d graph per shape bucket,
used when the target itself runs compiled (``backend.compile`` on, target fast path compiled).

A draft step is a few dozen small operators; on a small draft their per-operator overhead, not
their arithmetic, is its cost. The eager :class:`~speculant.drafters.dflash.context.ContextCache`
grows and slices its buffers at Python-int offsets, which a ``dynamic=False`` graph would bake in,
so the compiled step keeps its own fixed-shape cache, in the manner of the target's
(``speculant/backends/torch/compiled.py``):

- **Static context.** Per layer, zero-filled key/value buffers ``[kv_heads, rows, hd]`` where
  buffer row == absolute position. The step writes the new context rows at ``start ..`` and the
  block's rows at ``position ..`` (``index_copy_`` at positions held in a tensor), then attends
  over every row with a keep-mask computed in the graph from those positions: rows at or past
  ``position + block`` are masked (rejected blocks, padding, earlier requests), and a sliding or
  causal layer's own limits are applied as ``attention_mask`` does eagerly. Rows a sliding draft
  never projects (older than its widest window) are masked by the window.
- **Buckets.** New context rows are padded up to a power of two (1 .. the block: a cycle commits
  1 .. block rows); the padding rows are written after the real ones, where the block's rows or a
  later cycle overwrite them, and are masked until then. The block is always padded to the
  engine's block width (shorter blocks at the end of a request mask the extra rows out of every
  key set; they attend but their outputs are dropped). One graph per (context bucket, block,
  rows), each with a code object of its own, so a second cache entry is a recompilation
  (:attr:`CompiledDraft.recompiles`).
- **Eager edges.** A longer context (the prompt) has all but its last row written eagerly with
  the same modules; the block's embedding (the target's table) and the head stay eager.
- **Growth.** The buffers start at ``FIRST_ROWS`` and double when a request needs more (every
  graph compiled anew, once per size for the engine's life).
- **Ring.** When every layer slides, a block sees only the ``reach = max(window) - 1`` positions
  before it, so the buffers are a fixed ring instead: position ``p`` lives in row ``p % rows``,
  each row's position is kept in ``key_positions`` (written with the rows, in the graph), and the
  mask is computed from those positions. The ring holds ``reach`` positions plus two padded
  blocks, so no row a step reads is overwritten in that step; rows written in an earlier lap are
  more than a window away and masked. A long request then attends over a few hundred rows at
  most, and never grows the buffers (nor recompiles).
"""

from __future__ import annotations

import copy
import time
import types

import torch

from speculant.core.buffers import padded
from speculant.drafters.dflash.context import FIRST_ROWS
from speculant.drafters.dflash.visibility import keep_by_distance


class StaticSlot:
    """One layer's static buffers, joined with the block in place (the compiled ``context``);
    ``at``: the buffer rows of the block."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor) -> None:
        self.keys, self.values, self.at = keys, values, at

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(1, self.at, k)
        self.values.index_copy_(1, self.at, v)
        return self.keys, self.values


def keep_mask(block_at: torch.Tensor, keys: torch.Tensor, limit: torch.Tensor, causal: bool,
              window: int | None) -> torch.Tensor:
    """Boolean keep-mask [block, rows] from the queries' and each buffer row's positions: keys
    before ``limit``, within the layer's limits."""
    rel = block_at[:, None] - keys[None, :]  # query - key
    return keep_by_distance((keys < limit)[None, :].expand(block_at.shape[0], keys.shape[0]), rel, causal, window)


class CompiledDraft:
    """The compiled draft step of a :class:`~speculant.drafters.dflash.torch.DFlashModel`."""

    def __init__(self, model, block: int) -> None:
        self.model = model
        self.block = block
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        windows = [layer.window for layer in model.layers]
        self.reach = None if any(w is None for w in windows) else max(windows) - 1
        # with a ring: the buffer rows (fixed) and each row's position (unwritten rows: far away)
        self.ring = None if self.reach is None else padded(self.reach + 2 * padded(block))
        self.key_positions: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int, int], object] = {}
        self._codes: list[types.CodeType] = []
        self.compile_s = 0.0

    def fork(self) -> "CompiledDraft":
        """Buffers of its own (allocated on first use), the same graphs: they take the buffers as
        arguments, so one compiled per (bucket, block, rows) serves every fork."""
        other = copy.copy(self)
        other.keys, other.values, other.key_positions = [], [], None
        return other

    # -- cache -----------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def _fit(self, rows: int, like: torch.Tensor) -> None:
        """Buffers of at least ``rows`` rows (doubling), keeping the rows written so far; a ring's
        are allocated once."""
        if rows <= self.rows or (self.ring is not None and self.rows):
            return
        if self.ring is not None:
            size = self.ring
            self.key_positions = torch.full((size,), -(1 << 40), dtype=torch.long, device=like.device)
        else:
            size = max(FIRST_ROWS, self.rows)
            while size < rows:
                size *= 2
        attn = self.model.layers[0].self_attn
        shape = (attn.kv_heads, size, attn.head_dim)
        old = self.rows
        for store in (self.keys, self.values):
            for i in range(len(self.model.layers)):
                grown = torch.zeros(shape, dtype=like.dtype, device=like.device)  # finite under any mask
                if old:
                    grown[:, :old] = store[i]
                if i < len(store):
                    store[i] = grown
                else:
                    store.append(grown)
        # the graphs of the old size stay: they are keyed by rows, and a fork may still use them

    def rows_of(self, positions: torch.Tensor) -> torch.Tensor:
        """The buffer rows holding ``positions``."""
        return positions if self.ring is None else positions % self.ring

    def _write_eager(self, features: torch.Tensor, start: int, rotary, block_position: int) -> None:
        if self.reach is not None:  # a ring keeps only what the block can see
            skip = max(0, block_position - self.reach - start)
            features, start = features[skip:], start + skip
        m, n = self.model, features.shape[0]
        ctx = m.project_context(features)
        cos, sin = rotary(start, n)
        positions = torch.arange(start, start + n, device=features.device)
        at = self.rows_of(positions)
        if self.key_positions is not None:
            self.key_positions[at] = positions
        for i, layer in enumerate(m.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            self.keys[i][:, at] = k
            self.values[i][:, at] = v

    def context_rows(self, layer: int, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(first position, keys, values) of the context rows before ``end`` that are still held:
        all of them, or a ring's last ``reach``."""
        first = 0 if self.reach is None else max(0, end - self.reach)
        at = self.rows_of(torch.arange(first, end, device=self.keys[layer].device))
        return first, self.keys[layer][:, at], self.values[layer][:, at]

    # -- step ------------------------------------------------------------------------------
    def hidden(self, features: torch.Tensor, start: int, x: torch.Tensor, position: int, rotary) -> torch.Tensor:
        """Like ``TorchDFlashNetwork.hidden`` from the embedded block ``x`` [b, H]; ``rotary(start,
        count)`` gives cos/sin of positions ``start ..``."""
        n, b = features.shape[0], x.shape[0]
        width = max(self.block, b)
        if n > self.block:  # the prompt: all but its last row eagerly
            self._fit(start + n + width, x)
            self._write_eager(features[:-1], start, rotary, position)
            features, start, n = features[-1:], start + n - 1, 1
        bucket = padded(n)
        self._fit(max(start + bucket, position + width), x)
        features = torch.cat([features, features[-1:].expand(bucket - n, -1)])
        x = torch.cat([x, x[-1:].expand(width - b, -1)])
        ctx_cos, ctx_sin = rotary(start, bucket)
        cos, sin = rotary(position, width)
        where = torch.tensor([start, position, position + b], device=x.device)
        key = (bucket, width, self.rows)
        args = (features, ctx_cos, ctx_sin, x, cos, sin, where, self.keys, self.values, self.key_positions)
        graph = self._graphs.get(key)
        if graph is None:  # the first call traces and compiles
            started = time.perf_counter()
            graph = self._graphs[key] = self._compile(key)
            try:
                out = graph(*args)
            finally:
                self.compile_s += time.perf_counter() - started
        else:
            out = graph(*args)
        return out[: b - 1]

    def _compile(self, key):
        model = self.model

        rows_of = self.rows_of

        def step(features, ctx_cos, ctx_sin, x, cos, sin, where, keys, values, key_positions):
            ctx_at = where[0] + torch.arange(features.shape[0], device=x.device)
            block_at = where[1] + torch.arange(x.shape[0], device=x.device)
            ctx_rows, block_rows = rows_of(ctx_at), rows_of(block_at)
            if key_positions is None:  # buffer row == position
                key_at = torch.arange(keys[0].shape[1], device=x.device)
            else:  # a ring: the block's rows are written after the context's, as below
                key_positions.index_copy_(0, ctx_rows, ctx_at)
                key_positions.index_copy_(0, block_rows, block_at)
                key_at = key_positions
            ctx = model.project_context(features)
            masks = {}
            for i, layer in enumerate(model.layers):
                k, v = layer.self_attn.keys_values(ctx, ctx_cos, ctx_sin)
                keys[i].index_copy_(1, ctx_rows, k)
                values[i].index_copy_(1, ctx_rows, v)
                kind = (layer.causal, layer.window)
                if kind not in masks:
                    masks[kind] = keep_mask(block_at, key_at, where[2], *kind)
                x = layer(x, cos, sin, StaticSlot(keys[i], values[i], block_rows), masks[kind])
            return model.norm(x[1:])

        # a code object of its own: dynamo caches per code object, so buckets never share an entry
        step = types.FunctionType(step.__code__.replace(), step.__globals__, "draft_{}_{}_{}".format(*key), None,
                                  step.__closure__)
        self._codes.append(step.__code__)
        return torch.compile(step, fullgraph=True, dynamic=False)

    @property
    def recompiles(self) -> int:
        """Cache entries beyond one per compiled graph (a graph dynamo had to build again)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return sum(max(0, len(_debug_get_cache_entry_list(code)) - 1) for code in self._codes)

    def describe(self) -> str:
        buckets = sorted({key[0] for key in self._graphs})
        rows = f"ring of {self.rows} rows" if self.ring is not None else f"rows {self.rows}"
        return f"compiled draft: context buckets {', '.join(map(str, buckets)) or 'none yet'}; " \
               f"block {self.block}; {rows}; compile {self.compile_s:.1f} s"
