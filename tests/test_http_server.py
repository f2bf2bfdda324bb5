"""The API's HTTP server: uvicorn with a guarded protocol whose transport sends
what one turn of the event loop wrote as one write (http_server.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from intentledger.http_server import CoalescingTransport, server_options
from intentledger.ports import free_port


class RecordingTransport(asyncio.Transport):
    """What reaches the socket: each write, and whether it was closed or aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def write_eof(self) -> None:
        self.writes.append(b"<EOF>")

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


async def test_writes_of_one_turn_go_out_as_one_and_close_sends_them_first() -> None:
    loop = asyncio.get_running_loop()
    real = RecordingTransport()
    transport = CoalescingTransport(real, loop)
    transport.write(b"HTTP/1.1 202 Accepted\r\n\r\n")
    transport.write(b"{}")
    assert real.writes == [] and transport.get_write_buffer_size() == 27
    await asyncio.sleep(0)
    assert real.writes == [b"HTTP/1.1 202 Accepted\r\n\r\n{}"]
    transport.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    transport.close()  # what uvicorn does after its own 400: the answer still goes first
    assert real.writes[1:] == [b"HTTP/1.1 400 Bad Request\r\n\r\n"] and real.closed
    await asyncio.sleep(0)
    assert len(real.writes) == 2  # nothing after the close


async def test_writelines_and_the_end_of_the_stream_keep_the_order() -> None:
    real = RecordingTransport()
    transport = CoalescingTransport(real, asyncio.get_running_loop())
    transport.write(b"a")
    transport.writelines([b"b", b"c"])
    transport.write_eof()
    assert real.writes == [b"abc", b"<EOF>"]


async def test_an_abort_drops_what_waits_and_a_closed_socket_gets_nothing() -> None:
    loop = asyncio.get_running_loop()
    real = RecordingTransport()
    transport = CoalescingTransport(real, loop)
    transport.write(b"dropped")
    transport.abort()
    await asyncio.sleep(0)
    assert real.writes == [] and real.aborted
    other = RecordingTransport()
    transport = CoalescingTransport(other, loop)
    transport.write(b"too late")
    other.close()  # the peer went away before the turn ended
    await asyncio.sleep(0)
    assert other.writes == []


async def test_whether_it_is_closing_is_the_real_transports_and_asked_without_a_miss() -> None:
    real = RecordingTransport()
    transport = CoalescingTransport(real, asyncio.get_running_loop())
    assert transport.is_closing() is False
    transport.write(b"waiting")
    transport.close()
    assert transport.is_closing() is True and real.writes == [b"waiting"]
    # uvicorn asks after every response: a method of its own, not a miss
    # that `__getattr__` answers.
    assert "is_closing" in vars(CoalescingTransport)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    body = b'{"ok": true}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"12")],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server() -> Iterator[int]:
    """uvicorn on loopback with the API's protocol and options, in a thread."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        **server_options(5.0, 100),
    )
    instance = uvicorn.Server(config)
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    for _ in range(200):
        if instance.started:
            break
        threading.Event().wait(0.02)
    assert instance.started
    yield port
    instance.should_exit = True
    thread.join(10)


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_real_answers_arrive_whole_kept_alive_closed_and_refused(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server)) as sock:
        request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(request + request + b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_all(sock)  # ends when the server closes after the third
    assert answers.count(b"HTTP/1.1 200 OK") == 3 and answers.endswith(b'{"ok": true}')
    with socket.create_connection(("127.0.0.1", server)) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn answers 400 and closes
        assert read_all(sock).startswith(b"HTTP/1.1 400")
