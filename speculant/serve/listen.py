"""The listening socket and uvicorn's settings: checked and bound before any weights load, and
connections that stall before their request's headers are complete are closed."""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
from typing import Any

HEADER_TIMEOUT_S = 10.0  # a request's headers must be complete this long after its first byte
KEEP_ALIVE_S = 5  # an idle connection between requests is closed after this (uvicorn's default)


BIND_HINTS = {
    errno.EADDRINUSE: " (another process has that port: pick another with --port)",
    errno.EADDRNOTAVAIL: " (not an address of this machine: 127.0.0.1 or 0.0.0.0?)",
    errno.EACCES: " (ports below 1024 need privileges: pick another with --port)",
}


class ListenError(ValueError):
    """``--host``/``--port`` name no address this machine can listen on."""


def check_address(host: str, port: int) -> None:
    """Refuse what uvicorn would only refuse after the weights loaded, with a traceback."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ListenError(f"--port {port}: give a port from 1 to 65535")
    if not host.strip():
        raise ListenError(f"--host {host!r}: give an address: 127.0.0.1 (this machine only), 0.0.0.0 (every "
                          "IPv4 interface) or :: (every IPv6 interface)")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: uvicorn listens once it serves)."""
    check_address(host, port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn reads --host
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except socket.gaierror as exc:
        sock.close()
        raise ListenError(f"--host {host!r}: not an address or a name this machine can resolve "
                          f"({exc.strerror})") from None
    except OSError as exc:
        sock.close()
        raise ListenError(f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}"
                          + BIND_HINTS.get(exc.errno, "")) from None
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_config(app: Any, header_timeout: float = HEADER_TIMEOUT_S, **options: Any):
    """``uvicorn.Config`` for ``app`` whose HTTP protocol closes connections that stall."""
    import uvicorn

    if not (math.isfinite(header_timeout) and header_timeout > 0):
        raise ValueError(f"header_timeout must be a finite number of seconds > 0, not {header_timeout!r}")
    options.setdefault("timeout_keep_alive", KEEP_ALIVE_S)
    return uvicorn.Config(app, http=_guarded_protocol(header_timeout), **options)


def _guarded_protocol(header_timeout: float) -> type:
    """uvicorn's HTTP protocol (httptools or h11), plus a deadline for each request's headers:
    uvicorn itself closes idle connections between requests, but never one that sent nothing or
    part of its headers (a slow or hostile client could hold sockets open forever)."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_deadline: Any = None
        _deadline_cycle: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._between_requests() and (self._header_deadline is None or self._deadline_cycle is not self.cycle):
                self._arm()  # these bytes begin a new request: its headers are due by the deadline
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            super().connection_lost(exc)

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
            self._deadline_cycle = self.cycle
            self._header_deadline = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_late(self) -> None:
            self._header_deadline = None
            if self.cycle is self._deadline_cycle and self._between_requests():  # no new request began
                self.transport.close()

    return GuardedHTTPProtocol
