"""One engine, one request at a time: a bounded FIFO queue in front of a single worker thread.

Generation is synchronous and CPU/GPU bound, so it runs in the worker thread; chunks reach the
event loop through an ``asyncio.Queue``. The thread checks the job's cancel flag and deadline
after every chunk (one draft/verify cycle) and closes the generator, which frees the engine
and keeps the statistics of what was produced. The thread itself releases the turn, so a
client that vanished never leaves the engine held.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from speculant.core.metrics import GenerationStats
from speculant.core.types import Chunk
from speculant.serve.schemas import ApiError, client_left


logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often a waiting request asks whether its client is still there


@dataclass
class Started:
    """``engine.generate`` accepted the settings; chunks follow."""


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

    def put(self, item: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutdown)
            self.cancel.set()

    async def stream(self) -> AsyncIterator[Event]:
        while True:
            item = await self.events.get()
            yield item
            if isinstance(item, (Done, Failed)):
                return


class Worker:
    """Serializes requests to one engine; ``max_queue`` requests may wait, more get a 429."""

    def __init__(self, engine: Any, max_queue: int = 64, timeout: float = 600.0, on_queue=None,
                 on_finish: Callable[[GenerationStats], None] | None = None) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.timeout = timeout
        self.waiting = 0
        self._turn = asyncio.Lock()  # FIFO: asyncio wakes lock waiters in arrival order
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="speculant-engine")
        self._on_queue = on_queue or (lambda depth: None)
        # called in the worker thread with every generation's stats, however it ended: the
        # tokens of a stream whose client left or that timed out count like any others
        self._on_finish = on_finish or (lambda stats: None)

    async def submit(self, prompt_ids: list[int], max_new_tokens: int | None, overrides: dict[str, Any],
                     gone: Callable[[], Awaitable[bool]] | None = None) -> Job:
        """Wait for the engine (FIFO), start the job in the worker thread and return it. While it
        waits, ``gone`` is asked every ``POLL_S`` whether the client left; if so, it leaves the queue."""
        if self.waiting >= self.max_queue:
            raise ApiError(429, f"the server is busy: {self.waiting} requests are waiting (--max-queue "
                           f"{self.max_queue}); retry later", "rate_limit_error", code="queue_full")
        job = Job(prompt_ids, max_new_tokens, overrides, time.monotonic() + self.timeout)
        job.loop = asyncio.get_running_loop()
        self._queued(+1)
        try:
            await self._wait_turn(job.deadline, gone)
        finally:
            self._queued(-1)
        try:
            self._thread.submit(self._run, job)
        except BaseException:
            self._turn.release()
            raise
        return job

    async def _wait_turn(self, deadline: float, gone: Callable[[], Awaitable[bool]] | None) -> None:
        turn = asyncio.ensure_future(self._turn.acquire())
        try:
            while not turn.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(503, f"the request waited longer than the {self.timeout:g} s timeout for the "
                                   "engine", "server_error", code="timeout")
                await asyncio.wait({turn}, timeout=min(left, POLL_S))
                if not turn.done() and gone is not None and await gone():
                    raise client_left("while waiting for the engine")
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._turn.release()  # acquired just as the wait ended: pass the turn on
            else:
                turn.cancel()
            raise

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _queued(self, delta: int) -> None:
        self.waiting += delta
        self._on_queue(self.waiting)

    def _run(self, job: Job) -> None:
        """In the worker thread: generate, count the tokens, hand the end over, pass the turn on."""
        try:
            end = self._generate(job)
            if end.stats is not None:
                try:
                    self._on_finish(end.stats)  # before the client hears of the end, so /metrics agrees
                except Exception:  # noqa: BLE001  a metrics fault must not leave the client waiting
                    logger.exception("speculant: recording a request's metrics failed")
            job.put(end)
        finally:
            try:
                job.loop.call_soon_threadsafe(self._turn.release)
            except RuntimeError:
                pass

    def _generate(self, job: Job) -> Done | Failed:
        """Hand every chunk over; stop on cancel or deadline."""
        chunks = None
        try:
            chunks = self.engine.generate(prompt_ids=job.prompt_ids, max_new_tokens=job.max_new_tokens,
                                          **job.overrides)
            job.put(Started())
            timed_out = False
            try:
                for chunk in chunks:
                    job.put(chunk)
                    if job.cancel.is_set():
                        break
                    if time.monotonic() > job.deadline:
                        timed_out = True
                        break
            finally:
                chunks.close()  # frees the engine; the request's own record holds its stats
            return Done(chunks.stats, chunks.token_ids, timed_out)
        except Exception as exc:  # noqa: BLE001  every failure goes to the client, never kills the server
            return Failed(exc, None if chunks is None else chunks.stats)
