"""The DFlash drafting lifecycle, written once over a backend's :class:`DFlashNetwork`.

Per request: ``prefill`` and every ``commit`` queue the target's captured hidden states of the
committed positions; ``propose`` hands the queued rows to the network as new context (projected
once, their keys/values cached in every layer), denoises the block ``[anchor, mask x k]`` after
them, and picks each row's token from the draft logits: the target's bare head, then the
draft's own ``output_multiplier`` and soft-cap.

Two choices hold on every backend. When every layer slides, rows older than the widest window
can never be seen again, so they are never projected (``max_context``). The network's cache
writes the block's keys/values in place after the context's
(:class:`speculant.drafters.dflash.context.ContextCache`), so no cycle copies the context.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, Sequence

from speculant.core.interfaces import Drafter
from speculant.core.types import Array, Draft, DrafterInfo, DraftRequest, ForwardOutput
from speculant.drafters import compiled_forks
from speculant.drafters.dflash import muse_glimmer
from speculant.drafters.dflash.config import DFlashConfig
from speculant.drafters.dflash.context import ContextCache, leave_compiled


class DFlashNetwork(Protocol):
    """A backend's DFlash modules, their context cache and the target's shared weights."""

    cfg: DFlashConfig
    model: Any  # the backend's DFlashModel (its modules, as loaded and quantized)
    cache: ContextCache  # the eager step's context (a compiled step keeps rows by position)
    windows: Sequence[int | None]  # each layer's sliding window (None: full attention)

    def reset(self) -> None:
        """Empty the context cache (a new request)."""

    def fork(self) -> "DFlashNetwork":
        """The same modules (and compiled step, if any) with an empty context of their own."""

    def hidden(self, features: Array, context_start: int, block_ids: Array, position: int) -> Array:
        """Project new context rows (target features [n, F] at positions ``context_start ..``),
        cache their keys/values in every layer, run the block ``block_ids`` at ``position ..``
        over all cached context; return the final-normed rows 1.. of the block ([k, H])."""

    def head(self, hidden: Array) -> Array:
        """The target's bare head (``lm_head(raw=True)``) over draft rows, float32."""

    def tanh(self, x: Array) -> Array: ...

    def launch(self, tokens: Array) -> None:
        """Start computing ``tokens`` and the cache writes without waiting (lazy backends)."""

    # optional: ``hidden_rows(nets, contexts, block_ids, positions, widths)`` -> [rows, q - 1, H],
    # several forks' :meth:`hidden` in one forward (block_ids: host lists, one per row, all q long;
    # row r's rows past ``widths[r]`` are filler). A network without it drafts rows one by one.


class DFlashDrafter(Drafter):
    """Drafter protocol over a :class:`DFlashNetwork`; one sequence at a time (:meth:`fork` for more)."""

    def __init__(self, network: DFlashNetwork, info: DrafterInfo, backend: Any) -> None:
        self.net = network
        self.cfg = network.cfg
        self.info = info
        self.backend = backend
        self.ops = backend.ops
        windows = list(network.windows)
        # when every layer slides, older context rows can never be seen again
        self.max_context = None if any(w is None for w in windows) else max(windows) - 1
        self.pending: list[Array] = []
        self.context_length = 0  # absolute position one past the last context row taken in
        self._before_ahead: tuple | None = None  # what propose_ahead changed, for withdraw_ahead
        self.parked: Any = None  # the compiled step, left while this request drafts batched (compiled_forks)
        # a Muse Glimmer assistant reading the target's last layer gets its final-normed state
        self._final_feature = muse_glimmer.final_feature(self.cfg) if info.final_hidden == "post_norm" else None

    @property
    def fast_path(self) -> str:
        return getattr(self.net, "fast_path", "eager")

    @property
    def model(self) -> Any:
        return self.net.model

    def fork(self) -> "DFlashDrafter":
        """Shares the modules, the target and the compiled step's code; the queued context rows,
        the context cache (or the compiled step's buffers) and the draft-ahead mark are its own.
        Drafting ahead works in a fork as in the original."""
        other = copy.copy(self)
        other.net = self.net.fork()
        other.pending, other.context_length, other._before_ahead = [], 0, None
        compiled_forks.fork_parked(self, other)
        return other

    # -- lifecycle -------------------------------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        compiled_forks.resume(self)
        self.net.reset()
        self.pending = [self._features(output, None)]
        self.context_length = 0

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        self.pending.append(self._features(output, num_rows))

    def _features(self, output: ForwardOutput, rows: int | None) -> Array:
        features = output.features[:rows]
        j = self._final_feature
        if j is None:
            return features
        H = self.cfg.hidden_size
        final = output.final_hidden[:rows]
        return self.ops.concatenate([features[:, :j * H], final, features[:, (j + 1) * H:]], axis=1)

    def _take_context(self) -> tuple[Array, int]:
        """The queued feature rows the draft can still see, and the position of the first."""
        features = self.pending[0] if len(self.pending) == 1 else self.ops.concatenate(self.pending, axis=0)
        self.pending = []
        n = int(features.shape[0])
        start = self.context_length
        self.context_length += n
        if self.max_context is not None and n > self.max_context:
            start = self.context_length - self.max_context
            features = features[-self.max_context:]
        return features, start

    # -- drafting --------------------------------------------------------------------------
    def hidden(self, request: DraftRequest, anchor: Array | None = None) -> Array:
        """Final-normed draft hidden states of block rows 1..k ([k, H]); takes in the queued context.
        ``anchor`` (a one-token device array) stands for ``request.anchor_id`` when given."""
        features, start = self._take_context()
        masks = [self.cfg.mask_token_id] * request.num_tokens
        if anchor is None:
            ids = self.backend.int_array([request.anchor_id] + masks)
        else:
            ids = self.ops.concatenate([anchor, self.backend.int_array(masks)])
        return self.net.hidden(features, start, ids, request.position)

    def logits(self, hidden: Array) -> Array:
        """float32 draft logits: the bare head, as the published drafts and the trainer use it
        (``target.lm_head`` would apply the target's own logit transform, Gemma's soft-cap or
        Muse Glimmer's, which the draft's multiplier / soft-cap would repeat)."""
        logits = self.net.head(hidden)
        if self.cfg.is_muse_glimmer:  # transformers' DFlash drafts with the bare head alone
            return logits
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = cap * self.net.tanh(logits / cap)
        return logits

    def propose(self, request: DraftRequest, anchor: Array | None = None) -> Draft:
        hidden = self.hidden(request, anchor)
        return self._draft(request, hidden, self.logits(hidden))

    def _draft(self, request: DraftRequest, hidden: Array, logits: Array) -> Draft:
        """The proposal from the block's draft hidden rows and logits ([k, H], [k, V])."""
        tokens = self.ops.argmax(logits)
        self.net.launch(tokens)
        return Draft(token_ids=tokens, num_tokens=request.num_tokens, logits=logits)

    def propose_rows(self, drafters: Sequence[Drafter], requests: Sequence[DraftRequest]) -> list[Draft | None]:
        """Every row's block in one draft forward where the network can (eager PyTorch and MLX; a
        compiled draft step or a single row go one by one), each row's draft equal to its own
        :meth:`propose`: blocks as wide as the widest, each row seeing its own context and width."""
        rows = getattr(self.net, "hidden_rows", None)
        if len(drafters) < 2 or rows is None or not all(map(self._eager_fork, drafters)):
            return super().propose_rows(drafters, requests)
        q = 1 + max(r.num_tokens for r in requests)
        block_ids = [[r.anchor_id] + [self.cfg.mask_token_id] * (q - 1) for r in requests]
        contexts = [d._take_context() for d in drafters]
        hidden = rows([d.net for d in drafters], contexts, block_ids, [r.position for r in requests],
                      [r.num_tokens for r in requests])
        logits = self.logits(hidden)
        return [d._draft(r, hidden[i, :r.num_tokens], logits[i, :r.num_tokens])
                for i, (d, r) in enumerate(zip(drafters, requests))]

    def _eager_fork(self, other: Drafter) -> bool:
        """Whether ``other`` is this drafter or a fork of it with an eager context cache, after
        moving it off a compiled step (:mod:`speculant.drafters.compiled_forks`); not while a draft
        ahead is out (its withdrawal rewinds the step it was made with)."""
        if not isinstance(other, DFlashDrafter) or other.net.model is not self.net.model:
            return False
        if other._before_ahead is None:
            compiled_forks.park(other, lambda: leave_compiled(other.net, other.context_length))
        return getattr(other.net, "compiled", None) is None

    def propose_ahead(self, output: ForwardOutput, anchor: Array, request: DraftRequest) -> Draft | None:
        self._before_ahead = (list(self.pending), self.context_length, self.net.cache.mark())
        self.commit(output, int(output.features.shape[0]), ())
        return DFlashDrafter.propose(self, request, anchor)

    def withdraw_ahead(self) -> None:
        pending, length, mark = self._before_ahead
        self.pending, self.context_length, self._before_ahead = pending, length, None
        self.net.cache.rewind(mark)
