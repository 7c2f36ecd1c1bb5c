"""One request's chunks as :meth:`Engine.generate` hands them out, and its record."""

from __future__ import annotations

import inspect
import threading
from typing import Iterator

from speculant.core.metrics import GenerationStats
from speculant.core.types import Chunk


class _Record:
    """One request's outcome, filled in when it ends (shared by its Generation and its stream)."""

    stats: GenerationStats | None = None
    token_ids: list[int] = []

    def __init__(self) -> None:
        self.cancel = threading.Event()  # checked by the loop before every cycle


class _Cancelled(Exception):
    """Thrown into a waiting stream by :meth:`Generation.cancel`."""


class Generation(Iterator[Chunk]):
    """The chunks of one request, as :meth:`Engine.generate` returns them.

    Iterate it for text as it is produced; the last chunk carries the finish reason and the stats.
    ``stats`` and ``token_ids`` hold this request's own record once it has ended, closed early
    (``close()``: the engine is freed and what was produced is kept) or failed.

    An open generation holds the engine. Use it as a context manager (``with engine.generate(...)
    as generation:``) so that an exception in your own loop body, Ctrl-C included, closes it;
    ``cancel()`` ends it from any thread.
    """

    def __init__(self, chunks: Iterator[Chunk], record: _Record) -> None:
        self._chunks = chunks
        self._record = record
        self._step = threading.Lock()  # one next() / close() / cancel() at a time, from any thread
        self._final: Chunk | None = None  # the last chunk, made by a cancel() while nobody iterated

    def __next__(self) -> Chunk:
        with self._step:
            if self._final is not None:
                chunk, self._final = self._final, None
                return chunk
            return next(self._chunks)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """End the request now, keeping what was produced (``stop_reason`` ``"interrupted"``); the
        engine is free when this returns."""
        with self._step:
            self._chunks.close()

    def cancel(self) -> list[int]:
        """End the request from any thread, keeping what was produced; returns its token ids.

        A cycle in progress finishes first (this waits for it); the engine is free when this
        returns, and the iterator then yields a last chunk with ``stop_reason`` ``"cancelled"`` and
        the stats. Cancelling before the first chunk ends the request before its prefill; once the
        request has ended, it does nothing."""
        self._record.cancel.set()
        with self._step:
            state = inspect.getgeneratorstate(self._chunks) if inspect.isgenerator(self._chunks) else None
            if state == inspect.GEN_SUSPENDED and self._record.stats is None:
                try:
                    self._final = self._chunks.throw(_Cancelled())
                except StopIteration:
                    pass
        return self.token_ids

    @property
    def stats(self) -> GenerationStats | None:
        return self._record.stats

    @property
    def token_ids(self) -> list[int]:
        return list(self._record.token_ids)
