"""The provider client's pool: a connection for every call in flight, idle ones
dropped before the server would drop them, nothing sent once closed."""

from __future__ import annotations

import asyncio
import json

import pytest
import uvicorn

from intentledger.ports import free_port
from intentledger.providers import http
from intentledger.providers.http import ProviderClient


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def test_every_call_in_flight_has_a_connection_of_its_own() -> None:
    """The server answers nobody until all 40 calls have arrived: had one waited
    for another's connection, none would be answered and all would time out."""
    calls = 40
    arrived = 0
    everyone = asyncio.Event()

    async def answer_when_all_arrived(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal arrived
        await reader.readuntil(b"\r\n\r\n")
        arrived += 1
        if arrived == calls:
            everyone.set()
        await everyone.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    port = free_port()
    server = await asyncio.start_server(answer_when_all_arrived, "127.0.0.1", port)
    client = ProviderClient(calls, base_url=f"http://127.0.0.1:{port}")
    try:

        async def call() -> int:
            return (await client.request("GET", "/")).status_code

        async with asyncio.timeout(10):
            assert await asyncio.gather(*(call() for _ in range(calls))) == [200] * calls
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_calls_go_over_the_wire_on_kept_connections() -> None:
    connections = 0

    async def count_and_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _answer_ok(reader, writer)

    port = free_port()
    server = await asyncio.start_server(count_and_answer, "127.0.0.1", port)
    client = ProviderClient(4, base_url=f"http://127.0.0.1:{port}")
    try:

        async def call() -> int:
            return (await client.request("GET", "/")).status_code

        assert await asyncio.gather(*(call() for _ in range(10))) == [200] * 10
        assert connections <= 4
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_a_connection_idle_longer_than_the_client_keeps_one_is_not_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client, not the server, ends an idle connection: a server closing one
    as a request arrives on it loses the request (docs/benchmarks.md)."""
    # Shortened so the test does not wait seconds; the rule is the same.
    monkeypatch.setattr(http, "IDLE_CONNECTION_SECONDS", 0.3)
    connections = 0

    async def count_and_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _answer_ok(reader, writer)

    port = free_port()
    server = await asyncio.start_server(count_and_answer, "127.0.0.1", port)
    client = http.ProviderClient(1, base_url=f"http://127.0.0.1:{port}")
    try:
        await client.request("GET", "/")
        await client.request("GET", "/")
        assert connections == 1  # kept while in use
        await asyncio.sleep(0.5)
        await client.request("GET", "/")
        assert connections == 2  # idle too long: dropped, a new one opened
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


def test_the_client_drops_idle_connections_before_the_sandbox_server_would() -> None:
    assert uvicorn.Config(app=None).timeout_keep_alive > http.IDLE_CONNECTION_SECONDS


async def test_a_closed_client_refuses_calls() -> None:
    client = ProviderClient(4, base_url="http://127.0.0.1:9")
    await client.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await client.request("GET", "/")


async def test_a_json_body_reaches_the_provider_as_the_json_sent() -> None:
    """orjson writes the body (http.request_body); the server parses what the
    standard library would have sent, an integer beyond 64 bits and text
    outside ASCII included, under the JSON content type."""
    bodies = [
        {"amount": 1250, "currency": "EUR", "metadata": {"note": 'café ✓ "quoted"'}},
        {"reference": "op_1", "big": 2**70, "nested": [1, None, True, "x"]},
    ]
    received: list[tuple[bytes, bytes]] = []

    async def record_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                fields = dict(
                    line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line
                )
                length = int(fields[b"Content-Length"])
                received.append((fields[b"Content-Type"], await reader.readexactly(length)))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    port = free_port()
    server = await asyncio.start_server(record_body, "127.0.0.1", port)
    client = ProviderClient(2, base_url=f"http://127.0.0.1:{port}")
    try:
        for body in bodies:
            assert (await client.request("POST", "/v1/charges", json=body)).status_code == 200
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert [json.loads(raw) for _, raw in received] == bodies
    assert [kind for kind, _ in received] == [b"application/json"] * 2


async def test_the_tls_trust_is_loaded_with_the_client_and_once_a_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Loading the CA bundle takes milliseconds of CPU: done at a client's first
    call, it would hold the event loop, and every call of the first claim with
    it. It is loaded when the client is made, once for every client of the
    process, and never by a call."""
    http._tls_context.cache_clear()
    loads: list[object] = []
    create = http.ssl.create_default_context

    def counted(*args: object, **kwargs: object) -> object:
        loads.append(object())
        return create(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(http.ssl, "create_default_context", counted)
    port = free_port()
    server = await asyncio.start_server(_answer_ok, "127.0.0.1", port)
    first = ProviderClient(4, base_url=f"http://127.0.0.1:{port}")
    second = ProviderClient(4, base_url=f"http://127.0.0.1:{port}")
    assert len(loads) == 1, "made with the first client, shared by the second"
    try:
        assert (await first.request("GET", "/")).status_code == 200
        assert (await second.request("GET", "/")).status_code == 200
        assert len(loads) == 1, "no call loads it"
    finally:
        await first.aclose()
        await second.aclose()
        server.close()
        await server.wait_closed()
