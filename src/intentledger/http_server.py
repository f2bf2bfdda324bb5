"""Serving HTTP: uvicorn, guarded against clients that hold connections open.

uvicorn closes idle keep-alive connections, but a client that sends a request's
head a byte at a time keeps its connection (and a file descriptor) for ever:
300 of them were all still open after 130 s. `SlowHeadGuard` closes a
connection whose request head has not arrived within `header_timeout` of the
connection opening or of the request's first byte. The body has its own bound
in the edge (api/edge.py: 408), and `limit_concurrency` caps the connections
and requests one process takes on at once (uvicorn answers 503 beyond it).

uvicorn writes a response's head and its body as they come, each a system call
and a TCP segment of its own. `CoalescingTransport` sends what one turn of the
event loop wrote as one: about 5 µs less CPU per response (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport whose writes wait for the end of the event loop's turn and go
    out together: a response's head and body, written one after the other by
    the same task, become one system call. Every way of writing keeps the
    order; closing and ending the stream send what waits first; aborting
    drops it, as the real transport's abort drops its buffer. Anything else is
    the real transport's."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._waiting: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._waiting:
            self._loop.call_soon(self._flush)
        self._waiting.append(data)

    def _flush(self) -> None:
        if not self._waiting:
            return
        data = b"".join(self._waiting)
        self._waiting.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._waiting.clear()
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._waiting))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(header_timeout: float) -> type[HttpToolsProtocol]:
    class SlowHeadGuard(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(
                cast(asyncio.Transport, CoalescingTransport(transport, self.loop))
            )
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            self.transport.close()

    return SlowHeadGuard


def server_options(header_timeout: float, max_connections: int) -> dict[str, Any]:
    """uvicorn options for a guarded API process."""
    return {"http": guarded_protocol(header_timeout), "limit_concurrency": max_connections}
