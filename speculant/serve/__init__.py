"""``speculant serve``: an OpenAI-compatible HTTP server over one engine (needs the [serve] extra).

One engine verifies up to ``max_batch`` requests together in one target forward a cycle
(``speculant.core.scheduler``); others wait in a bounded FIFO queue.
"""

from __future__ import annotations

from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# requests verified together (--max-batch): on the default pair on a CPU (docs/batching.md) 16 gave
# 5.1x one stream's tokens/s; 32 gave 15 % more, each cycle (so each request) taking 1.7x as long
DEFAULT_MAX_BATCH = 16


def create_app(engine: Any, **options: Any):
    """The ASGI app serving ``engine``; see :func:`speculant.serve.app.create_app`."""
    from speculant.serve.app import create_app as build

    return build(engine, **options)


def run(engine: Any, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, log_level: str = "info",
        sock: Any = None, **options: Any) -> None:
    """Serve ``engine`` with uvicorn until interrupted, on ``sock`` when given (a socket from
    :func:`speculant.serve.listen.bind`, bound before the weights loaded), else on ``host:port``."""
    from speculant.serve.listen import bind, uvicorn_config

    import uvicorn

    sock = sock if sock is not None else bind(host, port)
    config = uvicorn_config(create_app(engine, **options), log_level=log_level, limit_concurrency=None,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
