"""The provider client's pools: enough connections in all, the least busy pool first."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import httpx
import pytest
import uvicorn

from intentledger.providers import http
from intentledger.providers.http import SHARD_CONNECTIONS, ShardedClient
from tests.support import free_port


def pool_limits(transport: httpx.AsyncHTTPTransport) -> int:
    return int(transport._pool._max_connections)


async def test_every_call_in_flight_has_a_connection_of_its_own() -> None:
    clients = ShardedClient(200)
    try:
        with ExitStack() as stack:
            leased = [stack.enter_context(clients.lease()) for _ in range(200)]
            # Spread evenly: no pool is asked for more connections than it has.
            for client in set(leased):
                assert leased.count(client) <= pool_limits(client) <= SHARD_CONNECTIONS
        assert sum(pool_limits(c) for c in set(leased)) >= 200
    finally:
        await clients.aclose()


async def test_a_call_takes_a_pool_with_the_fewest_calls_in_flight() -> None:
    clients = ShardedClient(3 * SHARD_CONNECTIONS)
    try:
        with clients.lease() as busy:
            with clients.lease() as other:
                assert other is not busy
            with clients.lease() as a, clients.lease() as b:
                assert busy not in (a, b) and a is not b
            # `a` and `b` ended; only `busy` still has a call in flight.
            with clients.lease() as next_call:
                assert next_call is not busy
    finally:
        await clients.aclose()


async def test_calls_go_over_the_wire() -> None:
    port = free_port()
    server = await asyncio.start_server(_answer_ok, "127.0.0.1", port)
    clients = ShardedClient(4, base_url=f"http://127.0.0.1:{port}")
    try:

        async def call() -> int:
            return (await clients.request("GET", "/")).status_code

        assert await asyncio.gather(*(call() for _ in range(10))) == [200] * 10
    finally:
        await clients.aclose()
        server.close()
        await server.wait_closed()


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while await reader.readuntil(b"\r\n\r\n"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


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
    clients = http.ShardedClient(1, base_url=f"http://127.0.0.1:{port}")
    try:
        await clients.request("GET", "/")
        await clients.request("GET", "/")
        assert connections == 1  # kept while in use
        await asyncio.sleep(0.5)
        await clients.request("GET", "/")
        assert connections == 2  # idle too long: dropped, a new one opened
    finally:
        await clients.aclose()
        server.close()
        await server.wait_closed()


def test_the_client_drops_idle_connections_before_the_sandbox_server_would() -> None:
    assert uvicorn.Config(app=None).timeout_keep_alive > http.IDLE_CONNECTION_SECONDS


async def test_a_closed_client_refuses_calls() -> None:
    clients = ShardedClient(4, base_url="http://127.0.0.1:9")
    await clients.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await clients.request("GET", "/")
