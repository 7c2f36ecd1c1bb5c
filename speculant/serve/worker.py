"""One engine, many requests: a bounded FIFO queue in front of one engine thread that runs a
:class:`~speculant.core.scheduler.Scheduler` (up to ``max_batch`` requests verified together).

Each request's settings are checked when it arrives (a bad one never waits or reaches the
engine). It waits in the queue until the scheduler has room; the engine thread then hands it to
the scheduler (the job's ``Started``), and maps every chunk the scheduler makes to its job. A
job's ``cancel`` event is its loop's own, so a client that leaves or a passed deadline ends that
request at the next cycle while the others go on; chunks reach the event loop through an
``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from speculant.core.metrics import GenerationStats
from speculant.core.request import Request
from speculant.core.scheduler import Scheduler
from speculant.core.types import Chunk
from speculant.serve import DEFAULT_MAX_BATCH
from speculant.serve.schemas import ApiError, client_left

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a waiting request asks whether its client is still there


@dataclass
class Started:
    """The scheduler took the request; chunks follow."""


@dataclass
class Done:
    stats: GenerationStats | None
    token_ids: list[int]
    timed_out: bool = False


@dataclass
class Failed:
    error: BaseException
    stats: GenerationStats | None = None


Event = Started | Chunk | Done | Failed


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int | None
    overrides: dict[str, Any]
    deadline: float  # time.monotonic() after which the generation stops
    loop: asyncio.AbstractEventLoop = field(default=None, repr=False)  # type: ignore[assignment]
    events: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    begun: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # its first event is queued
    request: Request | None = field(default=None, repr=False)
    timed_out: bool = False

    def put(self, item: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is gone (server shutdown)
            self.cancel.set()

    def _deliver(self, item: Event) -> None:
        self.events.put_nowait(item)
        self.begun.set()

    async def stream(self) -> AsyncIterator[Event]:
        while True:
            item = await self.events.get()
            yield item
            if isinstance(item, (Done, Failed)):
                return


class Worker:
    """Runs requests on one engine, ``max_batch`` at once; ``max_queue`` more may wait, more get a 429.

    ``on_finish`` is called in the engine thread with every request's stats, however it ended
    (the tokens of a stream whose client left or that timed out count like any others);
    ``on_cycle(live, batched_cycles)`` after every chunk with the requests in the scheduler and
    its batched cycles so far."""

    def __init__(self, engine: Any, max_queue: int = 64, timeout: float = 600.0, on_queue=None,
                 on_finish: Callable[[GenerationStats], None] | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                 on_cycle: Callable[[int, int], None] | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.timeout = timeout
        self.max_batch = max_batch
        self.waiting = 0  # requests not yet handed to the scheduler
        self.scheduler = Scheduler(engine, max_batch)
        self._on_queue = on_queue or (lambda depth: None)
        self._on_finish = on_finish or (lambda stats: None)
        self._on_cycle = on_cycle or (lambda live, cycles: None)
        self._pending: deque[Job] = deque()
        self._jobs: dict[object, Job] = {}  # request key -> job, for the requests in the scheduler
        self._ends: list[tuple[Job, list[Event]]] = []  # ended requests' last events, not yet handed over
        self._cycles = 0  # batched cycles of the schedulers before this one
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="speculant-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt_ids: list[int], max_new_tokens: int | None, overrides: dict[str, Any],
                     gone: Callable[[], Awaitable[bool]] | None = None) -> Job:
        """Check the request's settings, queue it and return once the scheduler took it (or its
        first event is a failure). While it waits, ``gone`` is asked every ``POLL_S`` whether the
        client left; if so, it leaves the queue without reaching the engine."""
        if self.waiting >= self.max_queue:
            raise ApiError(429, f"the server is busy: {self.waiting} requests are waiting (--max-queue "
                           f"{self.max_queue}); retry later", "rate_limit_error", code="queue_full")
        job = Job(prompt_ids, max_new_tokens, overrides, time.monotonic() + self.timeout)
        job.loop = asyncio.get_running_loop()
        try:
            job.request = self.engine.request(prompt_ids, max_new_tokens, cancel=job.cancel, **overrides)
        except Exception as exc:  # noqa: BLE001  a bad setting or prompt: the client's error, at once
            job.put(Failed(exc))
            return job
        self._queued(+1)
        try:
            with self._cond:
                self._pending.append(job)
                self._cond.notify()
            await self._wait_turn(job, gone)
        finally:
            self._queued(-1)
        return job

    async def _wait_turn(self, job: Job, gone: Callable[[], Awaitable[bool]] | None) -> None:
        try:
            while not job.begun.is_set():
                left = job.deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(503, f"the request waited longer than the {self.timeout:g} s timeout for the "
                                   "engine", "server_error", code="timeout")
                try:
                    await asyncio.wait_for(job.begun.wait(), min(left, POLL_S))
                except TimeoutError:
                    pass
                if not job.begun.is_set() and gone is not None and await gone():
                    raise client_left("while waiting for the engine")
        except BaseException:
            job.cancel.set()  # still queued: dropped unrun; taken just now: the scheduler ends it
            raise

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _queued(self, delta: int) -> None:
        self.waiting += delta
        self._on_queue(self.waiting)

    # -- the engine thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        """Sleep until requests wait, then run the scheduler while it has work, the engine held."""
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._drop_pending()
                    return
            if not self.engine._busy.acquire(timeout=POLL_S):  # a library call on this engine: wait for it
                continue
            try:
                self._drain()
            finally:
                self.engine._busy.release()
                self._flush_ends()

    def _drain(self) -> None:
        while self._feed():
            try:
                for request, chunk in self.scheduler.run():
                    self._hand_over(request, chunk)
                    self._on_cycle(len(self.scheduler.live), self._cycles + self.scheduler.batched_cycles)
                    if self._feed():
                        self._flush_ends()
                    self._check_deadlines()
            except Exception as exc:  # noqa: BLE001  a batched forward failed: every request in it fails
                logger.exception("speculant: the batch failed; its %d requests end with the error", len(self._jobs))
                self._fail_taken(exc)

    def _feed(self) -> bool:
        """Hand waiting requests to the scheduler while it has room; whether it has any work."""
        scheduler = self.scheduler
        with self._cond:
            if self._closed:
                self._drop_pending()
                for job in self._jobs.values():
                    job.cancel.set()
            while self._pending and len(scheduler.live) + scheduler.waiting < self.max_batch:
                job = self._pending.popleft()
                if job.cancel.is_set():  # the client left while it waited: it never reaches the engine
                    continue
                self._jobs[job.request.key] = job
                job.put(Started())
                scheduler.add(job.request)
        return bool(scheduler.live or scheduler.waiting)

    def _hand_over(self, request: Request, chunk: Chunk) -> None:
        job = self._jobs[request.key]
        if chunk.stop_reason is None:
            job.put(chunk)
            return
        del self._jobs[request.key]
        self._finished(chunk.stats)
        self.engine.last_stats, self.engine.last_token_ids = chunk.stats, list(request.loop.produced)
        if chunk.error is not None:  # this request alone failed; the others go on
            self._ends.append((job, [Failed(chunk.error, chunk.stats)]))
        else:
            self._ends.append((job, [chunk, Done(chunk.stats, list(request.loop.produced), job.timed_out)]))

    def _flush_ends(self) -> None:
        """The ended requests' last events: held until the engine is free when nothing else runs,
        so a client that heard its request end may use the engine at once (as a library call)."""
        ends, self._ends = self._ends, []
        for job, events in ends:
            for event in events:
                job.put(event)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for job in self._jobs.values():
            if now > job.deadline and not job.cancel.is_set():
                job.timed_out = True
                job.cancel.set()  # ends at its next cycle, with what it emitted (Done, timed_out)

    def _fail_taken(self, exc: Exception) -> None:
        """Every request the scheduler held fails with ``exc``; the waiting ones get a fresh scheduler."""
        for job in self._jobs.values():
            stats = None
            try:
                stats = job.request.final().stats
            except Exception:  # noqa: BLE001  the failed forward may have left its state unusable
                pass
            self._finished(stats)
            self._ends.append((job, [Failed(exc, stats)]))
        self._jobs.clear()
        self._cycles += self.scheduler.batched_cycles
        self.scheduler = Scheduler(self.engine, self.max_batch)
        self._on_cycle(0, self._cycles)

    def _finished(self, stats: GenerationStats | None) -> None:
        if stats is None:
            return
        try:
            self._on_finish(stats)  # before the client hears of the end, so /metrics agrees
        except Exception:  # noqa: BLE001  a metrics fault must not leave the client waiting
            logger.exception("speculant: recording a request's metrics failed")

    def _drop_pending(self) -> None:
        for job in self._pending:
            job.cancel.set()
        self._pending.clear()
