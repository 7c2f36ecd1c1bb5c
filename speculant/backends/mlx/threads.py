"""MLX streams of the threads that run compiled forwards, destroyed when those threads end.

MLX (0.32) gives each thread its own streams. A thread other than the main one that evaluated
``mx.compile``d graphs and ended without ``mx.clear_streams()`` left the process to abort at exit
("terminate called without an active exception", in about two exits of three here): the server
runs its engine on a worker thread, and so may a user. :func:`register` puts an object in the
thread's ``threading.local`` storage, which Python deletes in that thread as it ends; deleting it
destroys the thread's streams there.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_local = threading.local()


class _ClearStreams:
    def __del__(self) -> None:
        mx.clear_streams()


def register() -> None:
    """Destroy this thread's MLX streams when it ends (the main thread's are left to MLX)."""
    if threading.current_thread() is not threading.main_thread() and not hasattr(_local, "streams"):
        _local.streams = _ClearStreams()
