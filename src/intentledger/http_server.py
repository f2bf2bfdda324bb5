"""Serving HTTP: uvicorn on httptools, guarded against clients that hold
connections open or send endless request heads.

uvicorn closes idle keep-alive connections, but a client that sends a request's
head a byte at a time keeps its connection (and a file descriptor) for ever:
300 of them were all still open after 130 s. `HeadGuard` closes a
connection whose request head has not arrived within `header_timeout` of the
connection opening or of the request's first byte. The body has its own bound
in the edge (api/edge.py: 408), and `limit_concurrency` caps the connections
and requests one process takes on at once (uvicorn answers 503 beyond it).

Nothing below bounds a head's size: httptools (llhttp) accepts any length and
any number of header fields, gathering a field's pieces in memory until it
ends, and uvicorn keeps every field. Four connections trickling 32 MB heads
took a process from 130 MB to 320 MB. `HeadGuard` therefore counts what
arrives before a head is complete: more than `MAX_HEAD_BYTES` (as received, so
before httptools could gather it) or more than `MAX_HEADER_FIELDS` fields is
answered 431 Request Header Fields Too Large (RFC 6585) and the connection
closed; what the client still sends meanwhile is read and dropped, briefly,
so that closing does not reset the connection before the client reads the
answer. Both this answer and the 400 for what httptools cannot parse are
problem+json, like every other refusal.

uvicorn writes a response's head and its body as they come, each a system call
and a TCP segment of its own. `CoalescingTransport` sends what one turn of the
event loop wrote as one: about 5 µs less CPU per response (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from intentledger.web.problems import PROBLEM_BASE, PROBLEM_JSON

# A request head (request line and header fields) beyond these is refused 431.
# 16 KiB is h11's and Node's default; a bearer token, a console cookie and a
# proxy's forwarding fields take well under 2 KiB.
MAX_HEAD_BYTES = 16 * 1024
MAX_HEADER_FIELDS = 100
# How long a refused connection is drained before it is closed.
LINGER_SECONDS = 1.0


def _problem_answer(status: int, title: str, slug: str, detail: str) -> bytes:
    """A whole problem+json answer that closes the connection, for refusals
    made before any request reaches the application."""
    body = json.dumps(
        {"type": PROBLEM_BASE + slug, "title": title, "status": status, "detail": detail}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {title}\r\n"
        f"content-type: {PROBLEM_JSON}\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


_HEAD_TOO_LARGE = _problem_answer(
    431,
    "Request Header Fields Too Large",
    "request-head-too-large",
    f"a request head may hold at most {MAX_HEAD_BYTES} bytes and {MAX_HEADER_FIELDS} header fields",
)
# What httptools cannot parse (a malformed request line, a Content-Length past
# 64 bits): uvicorn's own answer is text/plain.
_NOT_HTTP = _problem_answer(
    400, "Bad Request", "malformed-request", "the request is not valid HTTP/1.1"
)


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

    def is_closing(self) -> bool:
        # uvicorn asks after every response. Found through `__getattr__`, the
        # lookup would first fail and make an AttributeError each time.
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def guarded_protocol(header_timeout: float) -> type[HttpToolsProtocol]:
    class HeadGuard(HttpToolsProtocol):
        # When the head being received must have ended (None: no head is).
        # The timer is not cancelled when a head ends in time: it checks this
        # when it fires and follows the next head's deadline, so a connection
        # busy with requests costs one timer per `header_timeout`, not one
        # made and cancelled per request.
        _head_deadline: float | None = None
        _head_timer: asyncio.TimerHandle | None = None
        # Between a message's end (or the connection's start) and its head's end.
        _in_head = True
        _head_ended_in_chunk = False
        # Bytes received while in a head, whole chunks, as they arrive...
        _head_received = 0
        # ...and the URL and fields httptools has handed over complete.
        _head_parsed = 0
        _fields = 0
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(
                cast(asyncio.Transport, CoalescingTransport(transport, self.loop))
            )
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # lingering: dropped, see _refuse_head
            was_in_head = self._in_head
            self._head_ended_in_chunk = False
            super().data_received(data)
            if was_in_head and self._in_head and not self._head_ended_in_chunk:
                # Every byte of this chunk belongs to an unfinished head.
                self._head_received += len(data)
                if self._head_received > MAX_HEAD_BYTES:
                    self._refused = True
            if self._refused:
                self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_received = self._head_parsed = self._fields = 0
            self._arm()

        def on_url(self, url: bytes) -> None:
            self._head_parsed += len(url)
            self._refused = self._refused or self._head_parsed > MAX_HEAD_BYTES
            if not self._refused:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._fields += 1
            self._head_parsed += len(name) + len(value) + 4  # ": " and CRLF
            self._refused = (
                self._refused
                or self._fields > MAX_HEADER_FIELDS
                or self._head_parsed > MAX_HEAD_BYTES
            )
            if not self._refused:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_deadline = None
            self._in_head = False
            self._head_ended_in_chunk = True
            if not self._refused:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._in_head = True
            if not self._refused:
                super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_NOT_HTTP)
            self.transport.close()

        def _refuse_head(self) -> None:
            self._disarm()
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                # A response to an earlier request is still being written:
                # an answer now would interleave with it.
                self.transport.close()
                return
            self.transport.write(_HEAD_TOO_LARGE)
            self.transport.write_eof()
            # Close after a moment even if the client goes on sending.
            self.loop.call_later(LINGER_SECONDS, self.transport.close)

        def _arm(self) -> None:
            """A head starts: the connection opened or a request's first byte came."""
            if self._head_deadline is None:
                self._head_deadline = self.loop.time() + header_timeout
            if self._head_timer is None:
                self._head_timer = self.loop.call_at(self._head_deadline, self._check_head)

        def _disarm(self) -> None:
            self._head_deadline = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _check_head(self) -> None:
            self._head_timer = None
            deadline = self._head_deadline
            if deadline is None:
                return  # no head is being received; the next one arms a timer
            if self.loop.time() < deadline:
                self._head_timer = self.loop.call_at(deadline, self._check_head)
                return
            self._head_deadline = None
            self.transport.close()

    return HeadGuard


def server_options(header_timeout: float, max_connections: int) -> dict[str, Any]:
    """uvicorn options for a guarded API process."""
    return {"http": guarded_protocol(header_timeout), "limit_concurrency": max_connections}
