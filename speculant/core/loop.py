"""One request's loop: prefill, then draft / verify / commit cycles, one path for every proposal.

A cycle asks the drafter for a free proposal (a prompt-lookup copy), else for a drafted one when
the verifier's policy says it pays; the verifier plans the width, the target verifies the block
in one forward, the caches roll back to what was accepted, and the drafter commits it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator

import numpy as np

from speculant.core.config import GenerationConfig, SamplingConfig
from speculant.core.errors import ContextTooLongError, GenerationError
from speculant.core.loop_batch import BatchedLoop
from speculant.core.metrics import GenerationStats, target_name
from speculant.core.prefix_request import PrefixRequest
from speculant.core.tree_cycle import tree_cycle, trees_allowed
from speculant.core.types import (Capture, CycleTiming, Draft, DraftRequest, DraftSource, ForwardOutput,
                                  PendingVerification, SamplingParams, Verification)

if TYPE_CHECKING:
    from speculant.core.engine import Engine
    from speculant.core.tree import DraftTree


@dataclass
class Proposal:
    """What a cycle submits to the target after ``anchor`` (the last emitted token)."""

    anchor: int
    draft: Draft | None  # planned to ``num_tokens``; None: a plain target step
    num_tokens: int
    drafted: int  # proposals the drafter made before the plan cut them
    source: DraftSource
    draft_s: float
    tree: "DraftTree | None" = None  # the tree verifier's, in place of the chain

    def block(self, ops) -> list[int]:
        """The block's token ids on the host: the anchor, then the draft (or the tree's nodes)."""
        if self.tree is not None:
            return list(self.tree.tokens)
        return [self.anchor] + ([] if self.draft is None else ops.to_list(self.draft.token_ids))


class Loop(BatchedLoop):
    """One generation: prefill, then draft / verify / commit cycles."""

    def __init__(self, engine: "Engine", prompt_ids, sampling_cfg: SamplingConfig, generation: GenerationConfig, block: int,
                 cancel: threading.Event | None = None, stream: int | None = None):
        self.e = engine
        # this sequence's own drafter and verifier state; the scheduler hands a batched one its own
        self.drafter, self.verifier = engine.drafter, engine.verifier
        self.cancel = cancel or threading.Event()
        self.prompt_ids = prompt_ids
        self.sampling = SamplingParams(sampling_cfg.temperature, sampling_cfg.top_p, sampling_cfg.top_k)
        # request ``stream`` of a batch sharing one seed draws from its own child of that seed (the
        # first from the seed itself, as it would alone): copies of one prompt are other samples
        seeds = np.random.SeedSequence(sampling_cfg.seed, spawn_key=(stream,) if stream else ()).spawn(2)
        self.verify_rng, self.draft_rng = (np.random.default_rng(seed) for seed in seeds)
        self.max_new = generation.max_new_tokens
        self.stop_ids = engine._stop_ids(generation)
        self.block = block
        self.produced: list[int] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self._stop_reason: str | None = None
        self._t0, self._t_first, self._finished = time.perf_counter(), None, False
        self.plain_streak = 0  # batched cycles in a row the scheduler's plan gave no drafts
        self.batch_stopped = False  # the batch turned drafting off (BatchedLoop.stop_for_batch)
        self.batched = False  # verified in a batch (core/scheduler.py) rather than on the target's own cache
        self.limit = limit = engine.verifier.max_context  # from this context on the request decodes plainly
        self.timed = engine.time_phases or engine.verifier.needs_timings
        self.stats.phases_timed = self.timed
        self.speculating = engine.drafter is not None and (limit is None or len(prompt_ids) < limit)
        self.position = len(prompt_ids)  # the target's cache length once the prompt is in
        self.draft_ahead = self.speculating and self._may_draft_ahead()
        self.trees = self.speculating and trees_allowed(engine)
        self._ahead: Draft | None = None  # the next cycle's draft, made before this one's verification
        self._ahead_anchor = None
        self._last_whole = True  # the last verified draft was accepted whole
        self.prefix = PrefixRequest(engine, prompt_ids, self.capture)
        self.window = window = engine.target.info.max_position_embeddings
        if window is not None and len(prompt_ids) >= window:
            raise ContextTooLongError(
                f"the prompt has {len(prompt_ids)} tokens but the target's context window is {window}; shorten the prompt"
            )

    def _may_draft_ahead(self) -> bool:
        e, setting = self.e, self.e.backend.config.draft_ahead
        wanted = setting == "on" or (setting == "auto" and e.backend.asynchronous)
        # timed phases would wait for each draft, and a sampled bonus token is drawn on the host
        return wanted and self.verifier.allows_draft_ahead and self.sampling.is_greedy and not self.timed

    def cancelled(self) -> bool:
        """True once ``cancel`` is set, which ends the request unless it already has a stop reason."""
        if self.cancel.is_set() and self._stop_reason is None:
            self._stop_reason = "cancelled"
        return self._stop_reason == "cancelled"

    def stop(self, reason: str) -> None:
        self._stop_reason = reason

    def truncate(self, n: int) -> None:
        del self.produced[n:]

    @property
    def ended(self) -> bool:
        """True once the request has a stop reason (a stop token, its length, a cancel)."""
        return self._stop_reason is not None or self.cancelled()

    def cycles(self) -> Iterator[list[int]]:
        """The request on the target's own cache (a batch of one): the first token, then cycles."""
        e = self.e
        try:
            if self.cancelled():
                return
            if not self.produced:  # else it comes back from a batch, its cache rebuilt (out_of_batch)
                e.backend.reset_peak_memory()
                e.target.reset()
                start = self.stats.cached_tokens = self.prefix.restore()
                out, _ = self._timed(lambda: self.prefix.prefill(start), "target_s")
                yield self.first(out)
                self.prefix.prompt_done()
            steps = self._greedy_steps(self.produced[-1]) if not self.ended else None
            if steps is not None:
                yield from self._plain_greedy(steps)
                return
            while not self.ended:
                yield self._cycle()
        except KeyboardInterrupt:  # Ctrl-C in any phase: the request ends with what was emitted
            self._stop_reason = "interrupted"
        except GenerationError as exc:
            self._stop_reason = "error"
            exc.token_ids = list(self.produced)
            raise

    def _started(self, out: ForwardOutput) -> list[int]:
        self.stats.cached_tokens = self.prefix.cached_tokens
        first = self.first(out)
        self.prefix.prompt_done()
        return first

    def first(self, out: ForwardOutput) -> list[int]:
        """The first token from the prompt's prefill ``out`` (its logits and captured rows); the
        drafter starts from it."""
        self.verifier.begin(len(self.prompt_ids))
        first = self._verify(None, out.logits[-1:]).token_ids
        self._t_first = time.perf_counter()
        if self.speculating:
            self._timed(lambda: self.drafter.prefill(self.prompt_ids, out, first[0]), "draft_s")
        return self._emit(first)

    def _greedy_steps(self, anchor: int):
        """The target's pipelined greedy path, for plain greedy requests that time nothing."""
        if self.drafter is not None or not self.sampling.is_greedy or self.timed:
            return None
        return self.e.target.greedy_steps(anchor)

    def _plain_greedy(self, steps) -> Iterator[list[int]]:
        try:
            for token in steps:
                self.verifier.observe(Verification(0, [token]), 0, CycleTiming(self.position, 0, 0, 0.0))
                new = self._emit([token])
                self.stats.record_cycle(0, 0, len(new))
                self.position += len(new)
                yield new
                if self.ended:
                    break
        finally:
            steps.close()
            self.e.target.crop(self.position)

    @property
    def capture(self) -> Capture:
        return self.drafter.info.capture if self.speculating else Capture()

    def _cycle(self) -> list[int]:
        """One cycle on the target's own cache: propose, verify in one forward, accept, crop."""
        e, position = self.e, self.position
        proposal = self.propose()
        if proposal.tree is not None:
            return tree_cycle(self, proposal)
        draft = proposal.draft
        anchor_arr = e.backend.int_array([proposal.anchor])
        block = anchor_arr if draft is None else e.backend.ops.concatenate([anchor_arr, draft.token_ids])
        out, target_s = self._timed(lambda: e.target.forward(block, self.capture), "target_s")
        if draft is not None and self.draft_ahead:
            n = proposal.num_tokens
            self._ahead = self._draft_ahead(out, position + n + 1, len(self.produced) + n + 1)
        new, length = self.accept(proposal, out, target_s)
        e.target.crop(length)
        return new

    def propose(self, most: int | None = None) -> "Proposal":
        """This cycle's proposal after the last emitted token: a draft planned to its width, at
        most ``most`` tokens (0, or none drafted: a plain step), or a tree for the tree verifier."""
        request = self.wanted_draft(most)
        if request is not None:
            self._drafted = self._timed(lambda: self.drafter.propose(request), "draft_s")
        return self.proposal()

    def wanted_draft(self, most: int | None = None) -> DraftRequest | None:
        """The first half of :meth:`propose`: the request for a model draft, when this cycle
        wants one (the scheduler drafts every row's at once, then calls :meth:`take_draft`);
        None when the proposal is settled without one (a free copy, a draft made ahead, a plain step)."""
        e, position, anchor = self.e, self.position, self.produced[-1]
        if self.limit is not None and position >= self.limit:
            self.speculating = False  # plain for the rest of this request; the drafter is reset by the next prefill
        k = self._room(position)
        ahead, self._ahead = self._ahead, None
        if most is not None and ahead is None:  # a draft made ahead is the drafter's state already: kept
            k = min(k, most)
        self._k, self._drafted = k, (None, 0.0)
        if ahead is not None and self.speculating and k > 0:
            self._drafted = (ahead if k >= ahead.num_tokens else ahead.truncated(k, e.backend.ops)), 0.0
        elif self.speculating and k > 0:
            request = DraftRequest(anchor, position, k, self.sampling, self.draft_rng)
            free = self.drafter.propose_free(request)
            if free is not None and self.trees and self.verifier.tree_next():  # the copy: one path of the tree
                beside, draft_s = self._timed(lambda: self.drafter.propose_beside(request, free), "draft_s")
                if beside is not None:
                    free, self._drafted = beside, (beside, draft_s)
            if free is None and self.verifier.wants_draft(k, position):
                length = min(k, max(1, self.verifier.draft_length(k, position)))
                return request if length == k else replace(request, num_tokens=length)
            self._drafted = (free, self._drafted[1])
        return None

    def take_draft(self, draft: Draft | None, seconds: float) -> None:
        """The model draft :meth:`wanted_draft` asked for, made beside other rows' in ``seconds`` (its share)."""
        self._drafted = (draft, seconds)
        if self.timed:
            self.stats.draft_s += seconds

    def proposal(self, trees: bool = True) -> "Proposal":
        """The second half of :meth:`propose`: the draft planned to its width, or a tree (with
        ``trees``; else the chain, which :meth:`as_tree` may turn into one)."""
        e, position, anchor = self.e, self.position, self.produced[-1]
        (draft, draft_s), k = self._drafted, self._k
        drafted = 0 if draft is None else draft.num_tokens
        source = DraftSource.MODEL if draft is None else draft.source
        n = self.verifier.plan(draft, k, position) if draft is not None else 0
        if draft is not None and n < draft.num_tokens:
            draft = draft.truncated(n, e.backend.ops) if n > 0 else None
        tree = self.verifier.tree(e.backend.ops, draft, anchor) if trees and self.trees and draft is not None else None
        return Proposal(anchor, draft, n, drafted, source, draft_s, tree)

    def accept(self, proposal: "Proposal", out: ForwardOutput, target_s: float,
               fetched: tuple[PendingVerification, list[float]] | None = None) -> tuple[list[int], int]:
        """Take the target's verification ``out`` of ``proposal``'s block: the tokens emitted and
        the cache length to crop the target back to (the caller crops). ``fetched``: this row's
        :meth:`pending` verification and its host values, fetched with other rows'."""
        position, n, draft = self.position, proposal.num_tokens, proposal.draft
        verification = fetched[0].finish(fetched[1]) if fetched else self._verify(draft, out.logits)
        accepted = verification.accepted
        self.prefix.committed(out, accepted + 1)
        if n > 0:
            self._last_whole = accepted == n
        commit_s = 0.0
        if self._ahead is not None and not self._keep_ahead(verification):
            self._ahead = None
            self.drafter.withdraw_ahead()
        if self.speculating and self._ahead is None:
            _, commit_s = self._timed(lambda: self.drafter.commit(out, accepted + 1, verification.token_ids), "draft_s")
        self.verifier.observe(verification, n, CycleTiming(position, n, proposal.drafted, target_s, proposal.draft_s,
                                                           commit_s, proposal.source))
        new = self._emit(verification.token_ids)
        self.stats.record_cycle(n, accepted, len(new), copied=proposal.source is DraftSource.LOOKUP)
        self.position += len(new)
        return new, position + accepted + 1

    def _room(self, position: int, produced: int | None = None) -> int:
        """Most proposals this cycle may verify: the block, what is left to generate, the window."""
        produced = len(self.produced) if produced is None else produced
        k = min(self.block - 1, self.max_new - produced - 1)
        return k if self.window is None else min(k, self.window - position - 1)

    def _draft_ahead(self, out, position: int, produced: int) -> Draft | None:
        """The next cycle's draft, queued before this cycle's verification is read, as if the
        whole block is accepted: every row of ``out`` committed, after the target's greedy token
        at its last row. Only after a cycle that was accepted whole, so a miss is rare."""
        e = self.e
        k = self._room(position, produced)
        if k <= 0 or not self._last_whole or (self.limit is not None and position >= self.limit):
            return None
        self._ahead_anchor = e.backend.ops.argmax(out.logits[-1:])
        request = DraftRequest(-1, position, k, self.sampling, self.draft_rng)  # the anchor is on the device
        draft = self.drafter.propose_ahead(out, self._ahead_anchor, request)
        if draft is not None:
            self.stats.drafts_ahead += 1
        return draft

    def _keep_ahead(self, verification: Verification) -> bool:
        """Whether the block was accepted whole (``_last_whole``, just updated) after the argmax the
        draft made ahead started from, so that draft is the next cycle's."""
        kept = self._last_whole and verification.token_ids[-1] == self.e.backend.ops.to_list(self._ahead_anchor)[0]
        self.stats.drafts_ahead_kept += int(kept)
        return kept

    def pending(self, proposal: "Proposal", out: ForwardOutput) -> PendingVerification | None:
        """The verifier's two-halved verification of ``proposal`` (None: it verifies whole)."""
        return self.verifier.pending(self.e.backend.ops, proposal.draft, out.logits, self.sampling, self.verify_rng)

    def _verify(self, draft, logits):
        return self.verifier.verify(self.e.backend.ops, draft, logits, self.sampling, self.verify_rng)

    def _emit(self, token_ids: list[int]) -> list[int]:
        """Commit tokens, cutting at a stop token (kept) and at max_new_tokens / the window."""
        new: list[int] = []
        for t in token_ids:
            new.append(t)
            self.produced.append(t)
            if t in self.stop_ids:
                self._stop_reason = "eos"
                break
            if len(self.produced) >= self.max_new:
                self._stop_reason = "max_new_tokens"
                break
            if self.window is not None and len(self.prompt_ids) + len(self.produced) >= self.window:
                self._stop_reason = "context_length"
                break
        return new

    def _timed(self, fn, total: str):
        """``(fn(), seconds)``; decode-time seconds also go to ``stats.<total>`` when timed.
        Untimed, the seconds only cover scheduling: lazy backends keep computing after it."""
        t = time.perf_counter()
        result = fn()
        if self.timed:
            self.e.backend.synchronize()
        elapsed = time.perf_counter() - t
        if self.timed and self._t_first is not None:
            setattr(self.stats, total, getattr(self.stats, total) + elapsed)
        return result, elapsed

    def finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        end = time.perf_counter()
        s = self.stats
        s.total_s = end - self._t0
        if self._t_first is not None:
            s.ttft_s = s.prefill_s = self._t_first - self._t0
            s.decode_s = end - self._t_first
        s.new_tokens, s.stop_reason = len(self.produced), self._stop_reason or "interrupted"
        s.peak_memory_bytes = self.e.backend.peak_memory_bytes()
        s.verifier = self.verifier.decisions()
        s.fast_path, s.draft_fast_path = self.e.target.fast_path, None if self.drafter is None else self.drafter.fast_path
        s.dtype, s.dtype_reason = self.e.backend.dtype_name, self.e.backend.dtype_reason
        s.target = target_name(self.e.target.info.path)
        self.prefix.finished(self.produced, s.stop_reason)
        s.prefix_cache_bytes, s.prefix_cache_hits = self.e.prefix_store.bytes, self.e.prefix_store.stats.hits
