"""Run an app on a free loopback port in a background thread (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator


@contextlib.contextmanager
def serving(app: Any, startup_timeout: float = 30.0, **config: Any) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of ``app`` served by uvicorn as ``speculant
    serve`` serves it (``config``: more :func:`speculant.serve.listen.uvicorn_config` options); stop on exit."""
    import uvicorn

    from speculant.serve.listen import uvicorn_config

    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it every response waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # loopback only, a port the OS picks
    port = sock.getsockname()[1]
    config.setdefault("log_level", "warning")
    server = uvicorn.Server(uvicorn_config(app, timeout_graceful_shutdown=2, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
