"""Serving HTTP: uvicorn, guarded against clients that hold connections open.

uvicorn closes idle keep-alive connections, but a client that sends a request's
head a byte at a time keeps its connection (and a file descriptor) for ever:
300 of them were all still open after 130 s. `SlowHeadGuard` closes a
connection whose request head has not arrived within `header_timeout` of the
connection opening or of the request's first byte. The body has its own bound
in the edge (api/edge.py: 408), and `limit_concurrency` caps the connections
and requests one process takes on at once (uvicorn answers 503 beyond it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def guarded_protocol(header_timeout: float) -> type[HttpToolsProtocol]:
    class SlowHeadGuard(HttpToolsProtocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
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
