"""The scheduler: the live requests of one engine, all verified in one target forward a cycle
(issue #39; docs/batching.md).

A request alone runs on the target's own cache (``Loop.cycles``: the compiled paths, trees,
drafting ahead, the prefix store). When a second one is admitted, the first moves into a
:class:`~speculant.core.batch.BatchedTarget` row (a copy of its caches) and
every cycle from then on proposes per request, verifies every request's block in one forward,
accepts per request (its own verifier state and random streams) and crops each row to its own
accepted length. Requests join and leave between cycles; the cycle code is ``Loop.propose`` /
``Loop.accept`` in both cases, so a batch of one is the same path as a batch of many.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Iterator

from speculant.core.arrays import fetch_rows
from speculant.core.batch_plan import EXPLORE_EVERY
from speculant.core.errors import GenerationError
from speculant.core.request import Request
from speculant.core.tree import kept_rows
from speculant.core.tree_cycle import accept_tree
from speculant.core.types import Capture, Chunk

if TYPE_CHECKING:
    from speculant.core.batch import BatchedTarget
    from speculant.core.batch_join import PendingJoin
    from speculant.core.engine import Engine
    from speculant.core.loop import Loop


ALONE_AFTER = 32  # the last request of a batch with this many tokens to go moves back onto the target's own cache
PLAIN_AFTER = 4  # when every batched request was planned plain this many cycles in a row, they stop speculating


class Scheduler:
    """Runs the requests added to it, up to ``max_batch`` at once, the rest waiting their turn.

    :meth:`add` may be called from any thread; :meth:`run` (one thread) yields each request's
    chunks as they are made, its last chunk (``stop_reason`` set) when it ends, and returns
    once no request is live or waiting. ``whole``: the caller wants every result together
    (``generate_many``), so once none waits the plan values tokens by how much sooner the batch's
    last request ends (BatchPlan.limits), not by each cycle's own rate."""

    def __init__(self, engine: "Engine", max_batch: int = 1, whole: bool = False) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.e = engine
        self.max_batch = max_batch
        self.whole = whole
        self.live: list[Request] = []
        self.prefilling: list[tuple[Request, "PendingJoin"]] = []  # long prompts joining a chunk a cycle
        self._joining = False  # the batch is kept while requests join it, even when it holds none yet
        self.rows: "BatchedTarget | None" = None  # while requests verify batched
        self.batch_refused: str | None = None  # why this target does not batch, once tried
        self._waiting: deque[Request] = deque()
        self._lock = threading.Lock()
        self._drafters = [] if engine.drafter is None else [engine.drafter]  # free per-sequence states
        self._verifiers = [engine.verifier]
        self.plan = engine.batch_plan  # the batched forward's cost and each row's width
        self.batched_cycles = 0
        self._drafted = (0, 0.0)  # this cycle's draft call: rows drafted, seconds

    def add(self, request: Request) -> None:
        with self._lock:
            self._waiting.append(request)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def run(self) -> Iterator[tuple[Request, Chunk]]:
        while True:
            yield from self._admit()
            if not self.live and not self.prefilling:
                return
            if self.rows is None:
                yield from self._solo(self.live[0])
            else:
                yield from self._cycle()
                yield from self._leave_ended()
                yield from self._prefill_chunk()
                self._maybe_alone()

    # -- admission -----------------------------------------------------------------------------
    def _next_waiting(self) -> Request | None:
        with self._lock:
            return self._waiting.popleft() if self._waiting else None

    def _admit(self) -> Iterator[tuple[Request, Chunk]]:
        joining: list[Request] = []  # admitted together: their prompts are prefilled together
        while len(self.live) + len(self.prefilling) < self.max_batch and self._waiting:
            if self.live and self.rows is None:  # the one live request has not started: both join a batch
                if not self._new_rows():
                    break  # this target does not batch: the next request waits for the live one
                joining.append(self.live[0])
            request = self._next_waiting()
            if request is None:
                break
            self._bind(request)
            self.live.append(request)
            if self.rows is not None:
                joining.append(request)
        if joining:
            yield from self._join(*joining)

    def _new_rows(self) -> bool:
        """Start a batch over the target; False where it cannot batch (the reason kept in
        :attr:`batch_refused`, and the requests then take turns)."""
        if self.batch_refused is not None:
            return False
        try:
            self.rows = self.e.target.new_batch(self.e.batch_layout)
        except (ValueError, NotImplementedError) as exc:
            self.batch_refused = str(exc)
            return False
        self.plan.padded = self.rows.padded  # how the plan prices a block: rows x widest, or each row's own
        return True

    def _bind(self, request: Request) -> None:
        """Give ``request`` a drafter and a verifier state of its own (the engine's first)."""
        loop, e = request.loop, self.e
        loop.verifier = self._verifiers.pop() if self._verifiers else e.verifier.fork()
        if e.drafter is None:
            return
        if self._drafters:
            loop.drafter = self._drafters.pop()
            return
        try:
            loop.drafter = e.drafter.fork()
        except NotImplementedError as exc:  # this drafter keeps one sequence: the request decodes plainly
            loop.drafter, loop.speculating = None, False
            loop.stats.batch_note = str(exc)

    def _join(self, *requests: Request) -> Iterator[tuple[Request, Chunk]]:
        """Add ``requests`` as rows: new ones are prefilled there (each from the longest stored
        prefix of its prompt; those the batch can, in one forward) and emit their first tokens;
        one that ran alone moves its caches in (Loop.into_batch)."""
        cancelled = [request for request in requests if request.loop.cancelled()]
        self._joining = True
        try:
            yield from self._join_all([request for request in requests if request not in cancelled])
        finally:
            self._joining = False
        # the cancelled ones end after the others joined: the batch may hold none until then
        # (with none it ends here, as a join that failed alone leaves it)
        yield from self._end(*cancelled)

    def _join_all(self, requests: list[Request]) -> Iterator[tuple[Request, Chunk]]:
        planned, together = [], []
        decoding = bool(self.rows.keys)  # rows that a long prompt's prefill would hold back
        for request in requests:
            loop = request.loop
            if not loop.produced and loop.speculating and not self._worth_drafting(loop):
                loop.stop_for_batch(f"decoded plainly: drafting did not pay beside {len(self.live) - 1} other requests")
            join = loop.planned_join(self.rows, request.key)
            if join is None:  # one that ran alone, or a prompt storing a checkpoint on its way
                yield from self._started(request, lambda: loop.into_batch(self.rows, request.key, self._capture()))
            elif decoding and 0 < self.rows.join_tokens < len(join[1]) - (join[2][1] if join[2] else 0):
                pending = self.rows.begin_join(*join[:2], self._capture(), join[2])  # (captures for it too)
                self.live.remove(request)  # it goes live again with its first token (_prefill_chunk)
                self.prefilling.append((request, pending))
            else:
                planned.append(join)
                together.append(request)
        if together:
            outs = self.rows.join_many(planned, self._capture())
            order = {key: row for row, key in enumerate(self.rows.keys)}
            self.live.sort(key=lambda r: order.get(r.key, -1))  # verify's blocks go in the rows' order
            for request, out in zip(together, outs):
                yield from self._started(request, lambda: request.loop.joined(out))

    def _prefill_chunk(self) -> Iterator[tuple[Request, Chunk]]:
        """One chunk of the first long prompt joining, between two cycles of the others; its
        first token once its last chunk is in."""
        if not self.prefilling:
            return
        request, pending = self.prefilling[0]
        if request.loop.cancelled():
            pending.cancel()
            self.prefilling.pop(0)
            yield from self._end(request)
        elif pending.step():
            self.prefilling.pop(0)
            self.live.append(request)  # its row is the batch's last, as in live
            yield from self._started(request, lambda: request.loop.joined(pending.output))

    def _started(self, request: Request, join) -> Iterator[tuple[Request, Chunk]]:
        """The first chunk of ``request`` once ``join()`` put it in the batch (its first tokens)."""
        try:
            new = join()
        except GenerationError as exc:
            request.error = exc
            request.loop.stop("error")
            yield from self._end(request)
            return
        chunk = request.chunk(new)
        if chunk is not None:
            yield request, chunk

    # -- one request alone, on the target's own cache ---------------------------------------------
    def _solo(self, request: Request) -> Iterator[tuple[Request, Chunk]]:
        cycles = request.loop.cycles()
        try:
            for new in cycles:
                chunk = request.chunk(new)
                if chunk is not None:
                    yield request, chunk
                if request.loop.ended:
                    break
                if self._waiting and self.max_batch > 1 and self._new_rows():
                    cycles.close()  # at a cycle's end, so its state holds the tokens emitted
                    yield from self._join(request)
                    return
        except GenerationError as exc:  # the loop kept what was emitted; the last chunk carries the error
            request.error = exc
        finally:
            cycles.close()
        yield from self._end(request)

    # -- a batched cycle ---------------------------------------------------------------------------
    def _cycle(self) -> Iterator[tuple[Request, Chunk]]:
        yield from self._leave_ended()  # cancelled since the last cycle
        live = list(self.live)
        if not live:
            return
        ops, cycle_start = self.e.backend.ops, time.perf_counter()
        proposals = self._proposals(live)
        blocks = [p.block(ops) for p in proposals]
        trees = [p.tree for p in proposals] if any(p.tree is not None for p in proposals) else None
        start = time.perf_counter()
        outs = self.rows.verify(blocks, self._capture(), trees)
        target_s = time.perf_counter() - start
        before = self.rows.lengths_before_block()
        fetched = self._fetched(live, proposals, outs)
        lengths, news, paths = [], [], []
        for request, proposal, out, first, host in zip(live, proposals, outs, before, fetched):
            path = None
            try:
                if proposal.tree is None:
                    new, length = request.loop.accept(proposal, out, target_s, host)
                else:
                    new, path = accept_tree(request.loop, proposal, out, target_s)
                    length, path = first + len(path), kept_rows(proposal.tree, path)
            except GenerationError as exc:  # this request ends with what it emitted; the others go on
                request.error, new, length, path = exc, [], first, None
                request.loop.stop("error")
            request.loop.stats.batched_cycles += 1
            lengths.append(length)
            news.append(new)
            paths.append(path)
        self.rows.crop(lengths, paths if trees else None)
        widths = [len(block) for block in blocks]
        computed = len(widths) * max(widths) if self.rows.padded else sum(widths)
        self.plan.observe(len(live), computed, time.perf_counter() - cycle_start, *self._drafted)
        self.batched_cycles += 1
        for request, new in zip(live, news):
            chunk = request.chunk(new)
            if chunk is not None:
                yield request, chunk

    def _fetched(self, live: list[Request], proposals: list, outs: list) -> list:
        """Each chain row's two-halved verification with its host values, every row's moved in one
        transfer (not one device synchronisation per row); None for a row verified whole."""
        pending = [None if p.tree is not None else r.loop.pending(p, out) for r, p, out in zip(live, proposals, outs)]
        values = iter(fetch_rows(self.e.backend.ops, [p.parts for p in pending if p is not None]))
        return [None if p is None else (p, next(values)) for p in pending]

    def _proposals(self, live: list[Request]) -> list:
        """Every row's proposal; the rows that want a model draft get theirs from one
        ``propose_rows`` call (one draft forward for all where the drafter can)."""
        wanted = [request.loop.wanted_draft(most) for request, most in zip(live, self._limits(live))]
        rows = [i for i, draft_request in enumerate(wanted) if draft_request is not None]
        self._drafted = (0, 0.0)  # the draft call's rows and seconds, for the plan
        if rows:
            start = time.perf_counter()
            drafts = self.e.drafter.propose_rows([live[i].loop.drafter for i in rows], [wanted[i] for i in rows])
            self._drafted = (len(rows), time.perf_counter() - start)
            for i, draft in zip(rows, drafts):
                live[i].loop.take_draft(draft, self._drafted[1] / len(rows))
        chains = [request.loop.proposal(trees=False) for request in live]
        # a row's tree as wide as the padded block the chains make (free there), or as its own chain where not padded
        widest = max(chain.num_tokens + 1 for chain in chains)
        return [request.loop.as_tree(chain, widest - 1 if self.rows.padded else chain.num_tokens)
                for request, chain in zip(live, chains)]

    def _worth_drafting(self, loop: "Loop") -> bool:
        """Whether a joining request starts its drafter; every ``EXPLORE_EVERY``-th one does anyway,
        so the pooled acceptance keeps being measured at this load."""
        self.plan.joins += 1
        others = [r.loop.stats for r in self.live if r.loop is not loop]
        return self.plan.joins % EXPLORE_EVERY == 0 or \
            self.plan.drafting_pays(len(others), loop._room(loop.position), others)

    def _limits(self, live: list[Request]) -> list[int | None]:
        """Each row's most drafts this cycle, from the cost model (None: as the verifier plans)."""
        if self.e.drafter is None:
            return [None] * len(live)
        loops = [request.loop for request in live]
        rooms = [loop.room_now() for loop in loops]
        ending = self.whole and not self._waiting and not self.prefilling
        left = [loop.max_new - len(loop.produced) for loop in loops] if ending else None
        limits = self.plan.limits(rooms, [loop.stats for loop in loops], left)
        for loop, room, most in zip(loops, rooms, limits):
            loop.plain_streak = loop.plain_streak + 1 if room and not most else 0
        speculating = [loop for loop in loops if loop.speculating]
        # A row planned plain goes on feeding its drafter while any row drafts (the hidden states
        # are captured for that row anyway), so it can draft again when the plan says so; once
        # none has drafted for a while, they all stop and the forwards capture nothing.
        if speculating and all(loop.plain_streak >= PLAIN_AFTER for loop in speculating) and \
                self.plan.settled([loop.stats for loop in loops]):
            for loop in speculating:
                loop.stop_for_batch(f"decoded plainly from token {len(loop.produced)}: drafting did not pay "
                                    f"beside {len(loops) - 1} other requests")
        return limits

    def _rejoin_at_this_load(self) -> None:
        """Rows the batch turned plain draft again where, with fewer rows now, a request joining
        would draft (BatchPlan.drafting_pays), as Loop.rejoin allows."""
        for loop in (r.loop for r in self.live if r.loop.stopped_by_batch()):
            others = [r.loop.stats for r in self.live if r.loop is not loop]
            if self.plan.drafting_pays(len(others), loop._room(loop.position), others):
                loop.rejoin(f"beside {len(others)} other requests" if others else "alone")

    def _maybe_alone(self) -> None:
        """The last request of a batch with tokens still to go moves back onto the target's own
        cache (its fast paths): a copy of its row, or one prefill of its context where the
        target cannot restore the row's snapshot."""
        if len(self.live) != 1 or self._waiting or self.prefilling:
            return
        loop, key = self.live[0].loop, self.live[0].key
        if loop.ended or loop.max_new - len(loop.produced) < ALONE_AFTER:
            return
        snapshot = self.rows.snapshot(key)
        self.rows.leave(key)
        self.rows = None
        loop.out_of_batch(snapshot)

    def _leave_ended(self) -> Iterator[tuple[Request, Chunk]]:
        ended = [r for r in self.live if r.loop.ended]
        if ended:
            yield from self._end(*ended)

    def _end(self, *requests: Request) -> Iterator[tuple[Request, Chunk]]:
        """``requests`` leave: their rows (in one copy of the batch's caches), drafters and
        verifier states are freed, their last chunks made."""
        finals = []
        for request in requests:
            if request in self.live:  # (not while its long prompt joins)
                self.live.remove(request)
            finals.append(request.final())  # stores the request's state in the prefix store, from its row if it has one
        if self.rows is not None:
            leaving = [request.key for request in requests if request.key in self.rows.keys]
            if leaving:
                self.rows.leave_many(leaving)
                self._rejoin_at_this_load()
            if not self.rows.keys and not self.prefilling and not self._joining:
                self.rows = None  # the next request alone runs on the target's own cache again
        for request, final in zip(requests, finals):
            loop = request.loop
            if loop.batched:
                self.plan.pool(loop.stats)
            loop.verifier.batched(False)  # its next request may run alone
            self._verifiers.append(loop.verifier)
            if loop.drafter is not None:
                self._drafters.append(loop.drafter)
            yield request, final

    def _capture(self) -> Capture:
        speculating = any(r.loop.speculating for r in self.live)
        return self.e.drafter.info.capture if speculating and self.e.drafter is not None else Capture()
