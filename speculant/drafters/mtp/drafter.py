"""The MTP drafting lifecycle, written once over a backend's :class:`MTPNetwork`.

Positions and pairs (mtp-and-verification.md §1.5). MTP layer 0 keeps, at position p, the
entry for the pair (target hidden h_p, token x_{p+1}); its output there predicts x_{p+2}.
Layer j > 0 (DeepSeek-style chained modules) keeps, at position q, the pair (recycled output of
layer j-1 at q-1, x_{q+1}); layer j therefore holds positions j, j+1, ... A RoPE offset that is
constant within a layer does not change attention, so this is the published chain
(module k at token i sees h_i^{k-1} and x_{i+k}) in a layout where recursion simply continues.

Drafting after committed positions 0..b (anchor x_{b+1} is the last committed token):
draft 1 comes from layer 0's output at b (computed at commit time); draft k+1 (k >= 1) runs
layer k mod n at position b + k on (recycled hidden of step k, draft k), appending one
speculative entry. The next commit crops every layer back to its committed length and writes
the new committed positions from the target's verify hidden states, bonus token included.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol, Sequence

from speculant.core.interfaces import Drafter
from speculant.core.types import Array, Draft, DrafterInfo, DraftRequest, ForwardOutput
from speculant.drafters import compiled_forks
from speculant.drafters.mtp.config import MTPConfig
from speculant.drafters.mtp.rows import active_rows


class MTPNetwork(Protocol):
    """Backend-specific MTP layers with one KV cache per layer."""

    cfg: MTPConfig

    def reset(self) -> None:
        """Empty every layer's cache."""

    def fork(self) -> "MTPNetwork":
        """The same layers (and compiled steps, if any) with empty caches of their own."""

    def run(self, layer: int, hidden: Array, token_ids: Array, positions: Sequence[int]) -> tuple[Array, Array]:
        """One MTP step over rows (hidden [n, H], token ids [n]) at ``positions``, appending
        to the layer's cache; returns the block output before and after the final norm."""

    def cache_length(self, layer: int) -> int: ...

    def crop(self, layer: int, length: int) -> None: ...

    def logits(self, hidden: Array) -> Array:
        """The target's LM head over final-normed MTP rows."""

    # optional: ``run_rows(nets, layer, hidden, token_ids, positions)``: :meth:`run` of one row
    # per fork ``nets[r]`` (draft steps) in one step. A network without it drafts rows one by one.


class MTPDrafter(Drafter):
    """Drafter protocol over an :class:`MTPNetwork`; one sequence at a time (:meth:`fork` for more)."""

    def __init__(self, network: MTPNetwork, info: DrafterInfo, backend: Any) -> None:
        self.net = network
        self.cfg = network.cfg
        self.info = info
        self.backend = backend
        self.ops = backend.ops
        self.parked: Any = None  # the compiled steps, left while this request drafts batched (compiled_forks)
        self._start()

    def _start(self) -> None:
        """No committed position yet (a new sequence)."""
        n = self.cfg.num_layers
        self._lengths = [0] * n
        self._carry: list[Array | None] = [None] * n
        self._head: Array | None = None
        self._next_position = 0
        self._anchor: int | None = None

    @property
    def fast_path(self) -> str:
        return getattr(self.net, "fast_path", "eager")

    def fork(self) -> "MTPDrafter":
        """Shares the MTP layers, the target and the compiled steps' code; the layers' caches,
        committed lengths, carried hidden rows and anchor are its own."""
        other = copy.copy(self)
        other.net = self.net.fork()
        other._start()
        compiled_forks.fork_parked(self, other)
        return other

    # -- lifecycle -------------------------------------------------------------------------
    def prefill(self, prompt_ids: Sequence[int], output: ForwardOutput, first_token_id: int) -> None:
        if output.final_hidden is None:
            raise ValueError("the target returned no final hidden state; the engine must capture DrafterInfo.final_hidden")
        compiled_forks.resume(self)
        self.net.reset()
        self._start()
        tokens = [int(t) for t in prompt_ids[1:]] + [int(first_token_id)]
        self._advance(output.final_hidden[: len(tokens)], tokens)

    def commit(self, output: ForwardOutput, num_rows: int, token_ids: Sequence[int]) -> None:
        if len(token_ids) != num_rows:
            raise ValueError(f"commit got {num_rows} committed rows but {len(token_ids)} emitted tokens")
        self._advance(output.final_hidden[:num_rows], [int(t) for t in token_ids])

    @property
    def cache_lengths(self) -> list[int]:
        return [self.net.cache_length(j) for j in range(self.cfg.num_layers)]

    @property
    def committed_length(self) -> int:
        """Positions of the committed sequence whose MTP entries exist (the anchor's is not)."""
        return self._next_position

    def _recycle(self, pre: Array, post: Array) -> Array:
        return pre if self.cfg.recycle_hidden == "pre_norm" else post

    def _advance(self, hidden: Array, tokens: list[int]) -> None:
        """Write committed positions a..b: target hidden rows h_a..h_b and tokens x_{a+1}..x_{b+1}."""
        a = self._next_position
        b = a + len(tokens) - 1
        ids = self.backend.int_array(tokens)
        carry = list(self._carry)
        previous: Array | None = None  # recycled outputs of the layer below, this commit
        for j in range(self.cfg.num_layers):
            self.net.crop(j, self._lengths[j])  # drop speculative entries
        for j in range(self.cfg.num_layers):
            start = max(a, j)
            if start > b:
                break
            if j == 0:
                h = hidden
            elif a >= j:  # the row at a-1 comes from the previous commit
                h = self._carry[j - 1] if b == a else self.ops.concatenate([self._carry[j - 1], previous[:-1]], axis=0)
            else:
                h = previous[:-1]
            pre, post = self.net.run(j, h, ids[start - a:], list(range(start, b + 1)))
            previous = self._recycle(pre, post)
            carry[j] = previous[-1:]
            if j == 0:
                self._head = post[-1:]
            self._lengths[j] = self.net.cache_length(j)
        self._carry = carry
        self._next_position = b + 1
        self._anchor = tokens[-1]

    # -- drafting --------------------------------------------------------------------------
    def propose(self, request: DraftRequest) -> Draft:
        sample = self._ready(request)
        b = self._next_position - 1
        token, prob = self._choose(self.net.logits(self._head), request, sample)
        tokens, probs = [token], [prob]
        h = self._carry[0]
        for k in range(1, request.num_tokens):
            pre, post = self.net.run(k % self.cfg.num_layers, h, token, [b + k])
            token, prob = self._choose(self.net.logits(post), request, sample)
            tokens.append(token)
            probs.append(prob)
            h = self._recycle(pre, post)
        return self._draft(request, tokens, probs if sample else None)

    def _ready(self, request: DraftRequest) -> bool:
        """Checks that ``request`` continues the committed state and drops the last draft's
        speculative entries; returns whether the drafts are sampled."""
        if request.position != self._next_position or request.anchor_id != self._anchor:
            raise RuntimeError(
                f"mtp drafter out of step: asked to draft after token {request.anchor_id} at position {request.position}, "
                f"but its committed state ends with token {self._anchor} at position {self._next_position}"
            )
        for j in range(self.cfg.num_layers):
            self.net.crop(j, self._lengths[j])
        return self.cfg.sample_drafts and not request.sampling.is_greedy

    def _draft(self, request: DraftRequest, tokens: list[Array], probs: list[Array] | None) -> Draft:
        """The proposal from each draft's token ([1]) and, when sampled, its q row ([1, V])."""
        ops = self.ops
        token_ids = tokens[0] if len(tokens) == 1 else ops.concatenate(tokens)
        draft_probs = None if probs is None else probs[0] if len(probs) == 1 else ops.concatenate(probs, axis=0)
        return Draft(token_ids=token_ids, num_tokens=request.num_tokens, draft_probs=draft_probs)

    def propose_rows(self, drafters: Sequence[Drafter], requests: Sequence[DraftRequest]) -> list[Draft | None]:
        """Draft step k of every row still drafting in one step of MTP layer k mod n (forks on
        compiled MLX steps leave them first; a single row goes alone), each row's draft equal to its own :meth:`propose`. Every MTP config batches
        (MoE, MLA, YaRN): projections, norms and MLPs treat rows independently, and each row's
        attention sees only its own fork's cache (``run_rows``, :mod:`speculant.drafters.mtp.rows`)."""
        run_rows = getattr(self.net, "run_rows", None)
        if len(drafters) < 2 or run_rows is None or not all(map(self._eager_fork, drafters)):
            return super().propose_rows(drafters, requests)
        samples = [d._ready(r) for d, r in zip(drafters, requests)]
        widths = [r.num_tokens for r in requests]
        chosen: list[list[tuple[Array, Array | None]]] = [[] for _ in requests]
        rows = list(range(len(requests)))  # every row drafts its first token, as propose does
        heads = self.ops.concatenate([drafters[r]._head for r in rows])
        tokens = self._choose_rows(self.net.logits(heads), rows, requests, samples, chosen)
        h = self.ops.concatenate([drafters[r]._carry[0] for r in rows])
        for k in range(1, max(widths, default=0)):
            still = active_rows(widths, k)
            if len(still) < len(rows):
                keep = self.backend.int_array([rows.index(r) for r in still])
                h, tokens, rows = h[keep], tokens[keep], still
            positions = [requests[r].position - 1 + k for r in rows]
            pre, post = run_rows([drafters[r].net for r in rows], k % self.cfg.num_layers, h, tokens, positions)
            tokens = self._choose_rows(self.net.logits(post), rows, requests, samples, chosen)
            h = self._recycle(pre, post)
        return [self._draft(request, [t for t, _ in picks], [p for _, p in picks] if sample else None)
                for request, picks, sample in zip(requests, chosen, samples)]

    def _choose_rows(self, logits: Array, rows: list[int], requests: Sequence[DraftRequest], samples: list[bool],
                     chosen: list[list]) -> Array:
        """Each of ``rows``' next token from its logits row (``logits[i]`` is ``rows[i]``'s), as
        :meth:`_choose` picks it, appended to ``chosen[row]``; returns the tokens [len(rows)]."""
        if not any(samples[r] for r in rows):
            tokens = self.ops.argmax(logits)
            for i, r in enumerate(rows):
                chosen[r].append((tokens[i:i + 1], None))
            return tokens
        for i, r in enumerate(rows):
            chosen[r].append(self._choose(logits[i:i + 1], requests[r], samples[r]))
        return self.ops.concatenate([chosen[r][-1][0] for r in rows])

    def _eager_fork(self, other: Drafter) -> bool:
        """Whether ``other`` is this drafter or a fork of it with eager caches, after moving it off
        compiled steps (:mod:`speculant.drafters.compiled_forks`)."""
        if not isinstance(other, MTPDrafter) or other.net.model is not self.net.model:
            return False
        compiled_forks.park(other, getattr(other.net, "leave_compiled", lambda: None))
        return getattr(other.net, "compiled", None) is None

    def _choose(self, logits: Array, request: DraftRequest, sample: bool) -> tuple[Array, Array | None]:
        """Argmax (one-hot q) or, when sampling drafts, an inverse-CDF draw from q with the
        target's temperature / top-k / top-p processing; q is returned as a [1, V] row."""
        if not sample:
            return self.ops.argmax(logits), None
        from speculant.core.sampling import inverse_cdf, target_probs

        if request.rng is None:
            raise ValueError("sampled MTP drafting needs DraftRequest.rng (a numpy Generator)")
        q = target_probs(self.ops, logits, request.sampling)
        u = float(request.rng.random())
        index = int(self.ops.to_list(inverse_cdf(self.ops, q, u))[0])
        return self.backend.int_array([index]), q
