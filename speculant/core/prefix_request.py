"""One request's use of the engine's prefix store (:mod:`speculant.core.prefix_cache`).

Before the prefill it restores the longest stored prefix of the prompt into the target's caches,
so only the rest is prefilled. The drafter is then started as on a cold request: from the stored
captured rows of the prefix joined to the prefill's own (DFlash's pending context features, MTP's
final hidden states), so every drafter resumes through its own ``prefill`` and none needs a
snapshot protocol of its own. After the prefill, and again when the request ends, it stores a
snapshot of the target's caches with the captured rows of every cached position. A request that
joins a batch (core/scheduler.py) does the same through its row (:meth:`PrefixRequest.join`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Sequence

from speculant.core.interfaces import TargetModel
from speculant.core.prefix_cache import CacheSnapshot, PrefixEntry
from speculant.core.types import Array, Capture, ForwardOutput

if TYPE_CHECKING:
    from speculant.core.batch import BatchedTarget, Join, Restored
    from speculant.core.engine import Engine

CHECKPOINT_MIN = 16  # shared tokens worth a snapshot of their own (one more prefill chunk and copy)
# stop reasons after which the caches hold exactly the committed rows (no half-run forward)
_CLEAN_STOPS = frozenset({"eos", "max_new_tokens", "stop_string", "context_length", "cancelled"})


class PrefixRequest:
    """Restore before the prefill, store after it and at the end; ``cached_tokens`` restored."""

    def __init__(self, engine: "Engine", prompt_ids: Sequence[int], capture: Capture) -> None:
        self.engine = engine
        self.store = engine.prefix_store
        self.prompt = tuple(int(t) for t in prompt_ids)
        self.capture = capture
        self.key: Hashable = state_key(engine, capture)
        # a target that takes no snapshots (the interface's default) leaves the store alone
        self.active = self.store.enabled and type(engine.target).snapshot is not TargetModel.snapshot
        self.cached_tokens = 0
        self._features: list[Array] = []  # captured rows of every cached position, in order
        self._final: list[Array] = []
        self._complete = True  # every cached position's rows were captured
        self.rows: "BatchedTarget | None" = None  # the batch whose row ``row_key`` holds this request's caches
        self.row_key: Hashable = None
        self._began = False  # the caches hold this request's state (it was prefilled or joined a batch)
        self._start = 0  # a join's restored prompt tokens (its output covers the rest)
        self._planned: dict = {}  # a plan planned_join made for join() to carry out

    # -- the prefill ------------------------------------------------------------------------
    def restore(self) -> int:
        """Put the longest stored prefix of the prompt into the target's caches; its length."""
        if not self.active:
            return 0
        found = self.store.lookup(self.key, self.prompt)
        if found is None:
            return 0
        entry, length = found
        if not self.engine.target.restore(entry.snapshot, length):
            return 0
        self._restored(entry, length)
        return length

    def _restored(self, entry: PrefixEntry, length: int) -> None:
        self.cached_tokens = length
        self._features = [] if entry.features is None else [entry.features[:length]]
        self._final = [] if entry.final_hidden is None else [entry.final_hidden[:length]]

    def join(self, rows: "BatchedTarget", key: Hashable, capture: Capture) -> ForwardOutput:
        """Join the batch ``rows`` as row ``key``: from the longest stored prefix of the prompt the
        batch can restore, prefilling the rest there (``capture``: the batch's rows this forward);
        the output over the whole prompt, as :meth:`prefill`'s. The row's state is stored from then
        on. A checkpoint at a shared prefix (see :meth:`prefill`) joins that prefix first, stores
        it, leaves, and joins again from it."""
        restored, split = self._planned.pop(key, None) or self._plan(rows, key)
        if split is not None:
            kept = list(self._features), list(self._final)
            checkpoint = self._checkpoint_row(rows, key, capture, restored, split)
            if checkpoint is None:  # not stored: the whole rest is run after all
                self._features, self._final = kept
            else:
                restored, self._start = (checkpoint, split), split
        return self.joined(rows.join(key, self.prompt, capture, restored))

    def planned_join(self, rows: "BatchedTarget", key: Hashable) -> "Join | None":
        """How to join the batch ``rows`` as row ``key`` (its prompt, the stored prefix it starts
        from), for the batch to run beside others' joins and hand the output to :meth:`joined`; None
        where the request must :meth:`join` alone (it stores a checkpoint on the way)."""
        restored, split = self._plan(rows, key)
        if split is None:
            return key, self.prompt, restored
        self._planned[key] = restored, split  # join() takes it from here (planning twice would see this prompt)
        return None

    def _plan(self, rows: "BatchedTarget", key: Hashable) -> tuple["Restored | None", int | None]:
        """The stored prefix a join into ``rows`` starts from, and where it stores a checkpoint (or None)."""
        self.rows, self.row_key, self._began = rows, key, True
        if not self.active:
            self._start = 0
            return None, None
        restored, self._start = self._restorable(rows)
        split = self._checkpoint(self._start)
        self.store.remember(self.key, self.prompt)
        return restored, split

    def joined(self, out: ForwardOutput) -> ForwardOutput:
        """The output over the whole prompt, from the join's ``out`` (over the rows it ran)."""
        if not self.active:
            return out
        self._take(out, len(self.prompt) - self._start)
        if not self._complete:  # the batch captured other rows than this request's key: nothing is stored
            return out
        ops = self.engine.backend.ops
        self._features, self._final = _compacted(ops, self._features), _compacted(ops, self._final)
        return ForwardOutput(out.logits, _first(self._features), _first(self._final))

    def _restorable(self, rows: "BatchedTarget") -> tuple["Restored | None", int]:
        """The longest stored prefix of the prompt ``rows`` can restore (taken as restored) and its length."""
        found = self.store.lookup(self.key, self.prompt)
        if found is None or not rows.can_restore(found[0].snapshot):
            return None, 0
        self._restored(*found)
        return (found[0].snapshot, found[1]), found[1]

    def _checkpoint_row(self, rows: "BatchedTarget", key: Hashable, capture: Capture, restored, split: int):
        """Row ``key`` holding the prompt's first ``split`` tokens, stored, then gone again: its snapshot or None."""
        out = rows.join(key, self.prompt[:split], capture, restored)
        self._take(out, split - (0 if restored is None else restored[1]))
        snapshot = self._store(self.prompt[:split])
        rows.leave(key)
        return snapshot

    def moved_into(self, rows: "BatchedTarget", key: Hashable) -> None:
        """The request's caches, as they stood on the target's own, are row ``key`` of ``rows`` now."""
        self.rows, self.row_key = rows, key

    def left_batch(self) -> None:
        """Back on the target's own cache (its row is gone)."""
        self.rows = self.row_key = None

    def prefill(self, start: int) -> ForwardOutput:
        """Prefill the prompt after the ``start`` restored tokens; the output over the whole prompt
        (the restored rows, then the prefill's). Where an earlier prompt shared more of this one
        than the store could restore and the target's snapshots cannot be cut (sliding windows,
        Gated DeltaNet), the prefill stops once at the shared prefix's end to store a snapshot
        there, which later prompts sharing it (an agent's system prompt) resume from."""
        target, prompt = self.engine.target, self.prompt
        self._began = True
        if not self.active:
            return target.prefill(prompt, self.capture)
        split = self._checkpoint(start)
        self.store.remember(self.key, prompt)
        bounds = [start, len(prompt)] if split is None else [start, split, len(prompt)]
        for a, b in zip(bounds, bounds[1:]):
            out = target.prefill(prompt[a:b], self.capture)
            self._take(out, b - a)
            if b == split:
                self._store(prompt[:split])
        ops = self.engine.backend.ops
        self._features, self._final = _compacted(ops, self._features), _compacted(ops, self._final)
        return ForwardOutput(out.logits, _first(self._features), _first(self._final))

    def _checkpoint(self, start: int) -> int | None:
        shared = self.store.shared_prefix(self.key, self.prompt)
        if shared - start < CHECKPOINT_MIN or self.store.cuttable(self.key):
            return None  # a cut-able snapshot serves any prefix already
        return shared

    def prompt_done(self) -> None:
        """Store the prompt's snapshot (called once the first token is out, so that the copy is
        not part of the time to first token; the caches still hold the prompt alone)."""
        if self.active:
            self._store(self.prompt)

    # -- while decoding --------------------------------------------------------------------
    def committed(self, out: ForwardOutput, rows: int) -> None:
        """A cycle's first ``rows`` rows (anchor and accepted drafts) are now in the caches."""
        if self.active:
            self._take(out, rows)

    def finished(self, produced: Sequence[int], stop_reason: str) -> None:
        """Store the caches as the request leaves them: the prompt and what was produced,
        less the last token (not yet run through the target)."""
        if not self.active or not self._began or stop_reason not in _CLEAN_STOPS:
            return  # (not begun: the caches hold another request's state)
        tokens = self.prompt + tuple(int(t) for t in produced)
        # a stop inside the last block leaves rows past the emitted tokens: only a cut target drops them
        self._store(tokens[: self._held()])

    # -- internals -------------------------------------------------------------------------
    def _take(self, out: ForwardOutput, rows: int) -> None:
        wanted = (bool(self.capture.layer_ids), self.capture.final_hidden is not None)
        got = (out.features is not None, out.final_hidden is not None)
        if wanted != got:  # the request stopped capturing (past the verifier's max_context)
            self._complete = False
            return
        if out.features is not None:
            self._features.append(out.features[:rows])
        if out.final_hidden is not None:
            self._final.append(out.final_hidden[:rows])

    def _store(self, tokens: tuple[int, ...]) -> "CacheSnapshot | None":
        """Store the caches as the state after ``tokens``; the snapshot, or None where none was taken."""
        if not self._complete or len(tokens) < 2:
            return None
        snapshot = self._snapshot()
        if snapshot is None:  # this target cannot snapshot (e.g. a compiled static cache), or the row is gone
            if self.rows is None:
                self.active = False
            return None
        if len(tokens) < snapshot.length and not snapshot.cuttable:
            return None
        ops = self.engine.backend.ops
        self._features = _compacted(ops, self._features)
        self._final = _compacted(ops, self._final)
        entry = PrefixEntry(tokens, snapshot, _rows(_first(self._features), len(tokens)),
                            _rows(_first(self._final), len(tokens)))
        self.store.store(self.key, entry)
        return snapshot

    def _snapshot(self):
        if self.rows is None:
            return self.engine.target.snapshot()
        return self.rows.snapshot(self.row_key) if self.row_key in self.rows.keys else None

    def _held(self) -> int:
        """Positions the request's caches hold."""
        if self.rows is None:
            return self.engine.target.cache_length
        keys = self.rows.keys
        return self.rows.lengths[keys.index(self.row_key)] if self.row_key in keys else 0


def state_key(engine: "Engine", capture: Capture) -> tuple:
    """What must agree, besides the tokens, for a stored prefix to serve a request: the backend,
    device, target and dtype, and the rows captured for the drafter (the layers it taps). The
    drafter's own state is rebuilt from those rows, so its kind and windows need not agree."""
    backend = engine.backend
    return (backend.name, str(backend.device), str(engine.target.info.path), backend.dtype_name,
            tuple(capture.layer_ids), capture.final_hidden)


def _rows(array: Array | None, n: int) -> Array | None:
    return None if array is None else array[:n]


def _first(arrays: list[Array]) -> Array | None:
    return arrays[0] if arrays else None


def _compacted(ops, arrays: list[Array]) -> list[Array]:
    return arrays if len(arrays) <= 1 else [ops.concatenate(arrays, axis=0)]
