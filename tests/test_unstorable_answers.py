"""A provider's answer is recorded whatever it holds, on both databases.

PostgreSQL stores neither the NUL character nor a lone surrogate in text or
jsonb, nor NaN or an infinity in jsonb; SQLite keeps all of them, and Python's
JSON parser makes each from an answer's body. Before this was read for
storage, a provider's success whose body held one could not be recorded on
PostgreSQL: the payment stayed SUBMITTING although the provider had moved the
money, and every later look met the same answer. Now each such character is
read as U+FFFD and each such number as its text (providers/http.py,
`ProviderResponse.json`), so the outcome is recorded and the rest of the answer
kept as it came.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.providers.http import ProviderResponse, storable_text
from intentledger.store.tables import observations_with_detail
from tests.conftest import free_port
from tests.test_dispatch import MovableClock, accept, make_worker, operation, rows

# A charge's success, with what PostgreSQL refuses where a provider may put it.
SUCCESSES: dict[str, tuple[bytes, Callable[[dict[str, Any]], Any], Any]] = {
    "a NUL in a value": (
        b'{"id": "ch_1", "status": "succeeded", "description": "a\\u0000b"}',
        lambda body: body["description"],
        "a\ufffdb",
    ),
    "a NUL in a name": (
        b'{"id": "ch_1", "status": "succeeded", "metadata": {"k\\u0000": "v"}}',
        lambda body: body["metadata"],
        {"k\ufffd": "v"},
    ),
    "a lone surrogate escaped": (
        b'{"id": "ch_1", "status": "succeeded", "description": "x\\ud800"}',
        lambda body: body["description"],
        "x\ufffd",
    ),
    "a lone surrogate in UTF-8's bytes": (
        b'{"id": "ch_1", "status": "succeeded", "description": "x\xed\xa0\x80"}',
        lambda body: body["description"],
        "x\ufffd",
    ),
    "NaN": (
        b'{"id": "ch_1", "status": "succeeded", "fee": NaN}',
        lambda body: body["fee"],
        "NaN",
    ),
    "infinities in a list": (
        b'{"id": "ch_1", "status": "succeeded", "rates": [Infinity, -Infinity, 1.5]}',
        lambda body: body["rates"],
        ["Infinity", "-Infinity", 1.5],
    ),
    "a NUL in the reference": (
        b'{"id": "ch_\\u0000", "status": "succeeded"}',
        lambda body: body["id"],
        "ch_\ufffd",
    ),
}


async def provider_answering(status: int, body: bytes) -> AsyncIterator[str]:
    async def charge(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/charges", charge)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def deliver_once(engine: AsyncEngine, status: int, body: bytes) -> tuple[str, Any]:
    """One payment delivered by a worker's batched path to a provider giving
    this answer; its operation id and its one observation."""
    clock = MovableClock()
    operation_id = await accept(engine, clock, "pm_ok")
    async for url in provider_answering(status, body):
        worker = make_worker(engine, url, clock)
        assert await worker.deliver_batch(limit=10) == 1
    (observed,) = await rows(engine, observations_with_detail, operation_id)
    return operation_id, observed


@pytest.mark.parametrize("case", list(SUCCESSES))
async def test_a_success_is_recorded_whatever_its_body_holds(
    engine: AsyncEngine, case: str
) -> None:
    body, part, stored = SUCCESSES[case]
    operation_id, observed = await deliver_once(engine, 200, body)
    settled = await operation(engine, operation_id)
    assert (settled.state, settled.outcome) == ("OUTCOME_KNOWN", "succeeded")
    assert observed.verdict == "succeeded"
    assert observed.provider_reference == settled.provider_reference
    detail = observed.detail if isinstance(observed.detail, dict) else json.loads(observed.detail)
    assert part(detail["body"]) == stored


async def test_a_refusal_that_is_not_json_is_recorded_with_its_nul_replaced(
    engine: AsyncEngine,
) -> None:
    # Not JSON: the reference path records its text, which held a NUL byte.
    operation_id, observed = await deliver_once(engine, 503, b"busy\x00now")
    assert (await operation(engine, operation_id)).state != "SUBMITTING"
    assert observed.http_status == 503
    detail = observed.detail if isinstance(observed.detail, dict) else json.loads(observed.detail)
    assert detail["body_text"] == "busy\ufffdnow"


async def test_a_retry_after_beyond_utf_8_is_recorded_with_its_byte_replaced(
    engine: AsyncEngine,
) -> None:
    # aiohttp reads a header's bytes beyond UTF-8 as lone surrogates, which
    # neither database stores: the answer's raw Retry-After held one.
    answer = (
        b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\xff\r\n"
        b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )

    async def answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answering, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clock = MovableClock()
    operation_id = await accept(engine, clock, "pm_ok")
    try:
        worker = make_worker(engine, f"http://127.0.0.1:{port}", clock)
        assert await worker.deliver_batch(limit=10) == 1
    finally:
        server.close()
        await server.wait_closed()
    (observed,) = await rows(engine, observations_with_detail, operation_id)
    assert (await operation(engine, operation_id)).state != "SUBMITTING"
    assert (observed.http_status, observed.retry_after_raw) == (503, "5\ufffd")


def response(content: bytes) -> ProviderResponse:
    return ProviderResponse(200, CIMultiDictProxy(CIMultiDict()), content)


def test_an_answer_with_nothing_to_replace_is_read_as_parsed() -> None:
    content = b'{"id": "ch_1", "amount": 18446744073709551616, "name": "Zo\xc3\xab", "l": [1.5]}'
    assert response(content).json() == json.loads(content)


@pytest.mark.parametrize(
    ("text", "stored"),
    [
        ("plain", "plain"),
        ("\x00", "\ufffd"),
        ("a\ud800b\udfff", "a\ufffdb\ufffd"),
        ("Zoë 😀", "Zoë 😀"),
    ],
)
def test_only_what_a_database_refuses_is_replaced(text: str, stored: str) -> None:
    assert storable_text(text) == stored
