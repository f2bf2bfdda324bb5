"""What a provider's answer proves: `classify` (the transport) with the sandbox
adapter's mapping (its responses), and `observe` against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from intentledger.domain.transport import (
    Classification,
    ProviderAnswer,
    Transport,
    Verdict,
    classify,
)
from intentledger.providers.http import ProviderClient, observe
from intentledger.providers.sandbox_client import (
    FINAL_REFUSAL_STATUSES,
    map_answer,
)
from intentledger.providers.sandbox_client import (
    KEY_CONFLICT_TYPES as KEY_CONFLICT_CODES,
)

NO_RESPONSE_ERRORS = [
    "aiohttp.SocketTimeoutError",
    "aiohttp.ServerDisconnectedError",
    "aiohttp.ClientOSError",
    "aiohttp.ClientPayloadError",
    "aiohttp.ClientResponseError",
    "builtins.TimeoutError",
]
NOT_SENT_ERRORS = ["aiohttp.ClientConnectorError", "aiohttp.ConnectionTimeoutError"]


def response(status: int, error_code: str | None = None) -> ProviderAnswer:
    """A sandbox response, read by the sandbox adapter's mapping."""
    body = {"error": {"type": "api_error", "code": error_code}} if error_code else {}
    answer = ProviderAnswer(
        Transport.RESPONSE, status=status, error_code=error_code, detail={"body": body}
    )
    return replace(answer, mapped=map_answer(answer))


def verdict(answer: ProviderAnswer) -> Verdict:
    return classify(answer).verdict


def test_a_response_no_adapter_mapped_proves_nothing() -> None:
    for status in (200, 402, 500):
        got = classify(ProviderAnswer(Transport.RESPONSE, status=status))
        assert got.verdict is Verdict.UNKNOWN and "not mapped" in got.reason


def test_the_adapters_mapping_decides_a_response() -> None:
    mapped = Classification(Verdict.FAILED, "the adapter says so")
    answer = ProviderAnswer(Transport.RESPONSE, status=200, mapped=mapped)
    assert classify(answer) is mapped


# --- classify, case by case -------------------------------------------------------------


@pytest.mark.parametrize("error_class", NOT_SENT_ERRORS)
def test_not_sent_is_not_executed(error_class: str) -> None:
    result = classify(ProviderAnswer(Transport.NOT_SENT, error_class=error_class))
    assert result.verdict is Verdict.NOT_EXECUTED
    assert error_class in result.reason


@pytest.mark.parametrize("error_class", NO_RESPONSE_ERRORS)
def test_no_response_is_unknown(error_class: str) -> None:
    result = classify(ProviderAnswer(Transport.NO_RESPONSE, error_class=error_class))
    assert result.verdict is Verdict.UNKNOWN
    assert error_class in result.reason


@pytest.mark.parametrize("status", [200, 201, 202, 204, 299])
def test_2xx_succeeded(status: int) -> None:
    assert verdict(response(status)) is Verdict.SUCCEEDED


@pytest.mark.parametrize("status", [400, 402, 422])
@pytest.mark.parametrize("error_code", [None, "card_declined", "resource_missing"])
def test_final_refusals_failed(status: int, error_code: str | None) -> None:
    assert verdict(response(status, error_code)) is Verdict.FAILED


@pytest.mark.parametrize("status", [400, 402, 422])
@pytest.mark.parametrize("error_code", sorted(KEY_CONFLICT_CODES))
def test_key_conflict_codes_are_unknown_never_failed(status: int, error_code: str) -> None:
    result = classify(response(status, error_code))
    assert result.verdict is Verdict.KEY_CONFLICT
    assert error_code in result.reason


def test_final_refusal_statuses_are_the_documented_ones() -> None:
    assert {400, 402, 422} == FINAL_REFUSAL_STATUSES


def test_key_conflict_codes_are_the_documented_ones() -> None:
    assert {"idempotency_error", "idempotency_key_reused", "idempotency_key_in_use"} <= (
        KEY_CONFLICT_CODES
    )


@pytest.mark.parametrize("error_code", [None, "idempotency_key_in_use", "card_declined"])
def test_409_is_a_key_conflict(error_code: str | None) -> None:
    assert verdict(response(409, error_code)) is Verdict.KEY_CONFLICT


@pytest.mark.parametrize("error_code", [None, "rate_limit"])
def test_429_is_not_executed(error_code: str | None) -> None:
    assert verdict(response(429, error_code)) is Verdict.NOT_EXECUTED


@pytest.mark.parametrize("status", [500, 501, 502, 503, 504, 599])
@pytest.mark.parametrize("error_code", [None, "card_declined", "api_error"])
def test_5xx_is_unknown(status: int, error_code: str | None) -> None:
    assert verdict(response(status, error_code)) is Verdict.UNKNOWN


@pytest.mark.parametrize("status", [100, 199, 301, 304, 401, 403, 404, 405, 408, 410, 418, 451])
def test_undocumented_statuses_are_unknown(status: int) -> None:
    assert verdict(response(status, "card_declined")) is Verdict.UNKNOWN


def test_response_without_status_is_a_programming_error() -> None:
    with pytest.raises(AssertionError):
        classify(ProviderAnswer(Transport.RESPONSE))
    with pytest.raises(AssertionError):
        map_answer(ProviderAnswer(Transport.RESPONSE))


# --- classify, as a property ------------------------------------------------------------

error_codes = st.one_of(
    st.none(),
    st.sampled_from(sorted(KEY_CONFLICT_CODES)),
    st.sampled_from(["card_declined", "rate_limit", "timeout", "resource_missing"]),
    st.text(max_size=30),
)


@given(status=st.integers(100, 599), error_code=error_codes)
def test_only_documented_refusals_fail_and_only_2xx_succeed(
    status: int, error_code: str | None
) -> None:
    got = verdict(response(status, error_code))
    assert (got is Verdict.FAILED) == (
        status in {400, 402, 422} and error_code not in KEY_CONFLICT_CODES
    )
    assert (got is Verdict.SUCCEEDED) == (200 <= status < 300)
    assert (got is Verdict.NOT_EXECUTED) == (status == 429)


@given(
    transport=st.sampled_from([Transport.NOT_SENT, Transport.NO_RESPONSE]),
    error_class=st.one_of(st.none(), st.sampled_from(NO_RESPONSE_ERRORS), st.text(max_size=30)),
    status=st.one_of(st.none(), st.integers(100, 599)),
    error_code=error_codes,
)
def test_without_a_response_never_succeeded_or_failed(
    transport: Transport, error_class: str | None, status: int | None, error_code: str | None
) -> None:
    answer = ProviderAnswer(
        transport, error_class=error_class, status=status, error_code=error_code
    )
    expected = Verdict.NOT_EXECUTED if transport is Transport.NOT_SENT else Verdict.UNKNOWN
    assert verdict(answer) is expected


# --- observe, over a real loopback socket ----------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """Serve `handler` on a loopback port; on exit, wait for every connection it took."""
    handlers: set[asyncio.Task[Any]] = set()

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()
        # Python 3.11's wait_closed does not wait for handlers; they end at the client's EOF.
        async with asyncio.timeout(5):
            await asyncio.gather(*handlers)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """Read one request (head and Content-Length body), so closing sends FIN, not RST."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    return head + await reader.readexactly(length)


def answering(status_line: str, headers: dict[str, str], body: bytes = b"") -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        lines = [f"HTTP/1.1 {status_line}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    return handler


def json_answer(status_line: str, document: object, **headers: str) -> Handler:
    body = json.dumps(document).encode()
    return answering(status_line, {"Content-Type": "application/json", **headers}, body)


async def post(base_url: str, timeout: float = 2.0) -> ProviderAnswer:
    client = ProviderClient(4, base_url, timedelta(seconds=timeout))
    try:
        call = client.request("POST", "/v1/charges", json={"amount": 100})
        return await observe(call, mapping=map_answer)
    finally:
        await client.aclose()


async def test_accepted_but_never_answered_is_no_response_socket_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # until the client gives up and hangs up
        writer.close()

    async with serving(silent) as url:
        answer = await post(url, timeout=0.3)
    assert answer.transport is Transport.NO_RESPONSE
    assert answer.error_class == "aiohttp.SocketTimeoutError"
    assert answer.status is None
    assert verdict(answer) is Verdict.UNKNOWN


async def test_closed_without_a_response_is_no_response_server_disconnected() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()
        await writer.wait_closed()

    async with serving(hang_up) as url:
        answer = await post(url)
    assert answer.transport is Transport.NO_RESPONSE
    assert answer.error_class == "aiohttp.ServerDisconnectedError"
    assert verdict(answer) is Verdict.UNKNOWN


async def test_body_cut_short_is_no_response_not_success() -> None:
    async def truncated(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"id": "ch_')
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    async with serving(truncated) as url:
        answer = await post(url)
    assert answer.transport is Transport.NO_RESPONSE
    assert answer.error_class == "aiohttp.ClientPayloadError"
    assert verdict(answer) is Verdict.UNKNOWN


async def test_nothing_listening_is_not_sent_connector_error() -> None:
    # Bound but not listening: the port is ours, and a connect is refused.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        answer = await post(f"http://127.0.0.1:{port}")
    assert answer.transport is Transport.NOT_SENT
    assert answer.error_class == "aiohttp.ClientConnectorError"
    assert verdict(answer) is Verdict.NOT_EXECUTED


async def test_a_malformed_answer_is_no_response() -> None:
    async with serving(answering("2OO OK", {})) as url:
        answer = await post(url)
    assert (answer.transport, answer.error_class) == (
        Transport.NO_RESPONSE,
        "aiohttp.ClientResponseError",
    )
    assert verdict(answer) is Verdict.UNKNOWN


async def test_a_post_the_provider_hung_up_on_is_not_sent_again() -> None:
    """A kept-alive connection the provider closed as our POST arrived: aiohttp
    resends only idempotent methods, so the provider sees the POST once and the
    answer stays unknown (a resend here would be a blind retry)."""
    requests: list[bytes] = []

    async def first_answers_then_hangs_up(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        requests.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            requests.append(await read_request(reader))
        # The second request on the kept connection is read, never answered.

    async with serving(first_answers_then_hangs_up) as url:
        client = ProviderClient(1, url)
        try:
            first = await observe(client.request("POST", "/v1/charges", json={}))
            second = await observe(client.request("POST", "/v1/charges", json={}))
        finally:
            await client.aclose()
    assert first.status == 200
    assert (second.transport, second.error_class) == (
        Transport.NO_RESPONSE,
        "aiohttp.ServerDisconnectedError",
    )
    assert len(requests) == 2  # one per call: the POST was not resent


async def test_a_call_that_waited_too_long_for_a_connection_was_never_sent() -> None:
    """ConnectionTimeoutError covers the wait for a pooled connection: the one
    connection is busy, so the second call gives up before writing anything."""
    heads: list[bytes] = []
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await read_request(reader))
        # A byte every 0.1 s keeps the busy call inside its read timeout.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        while not release.is_set():
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)

    async with serving(slow) as url:
        client = ProviderClient(1, url, timedelta(seconds=0.3))
        try:
            busy = asyncio.ensure_future(client.request("POST", "/a", json={}))
            await asyncio.sleep(0.05)
            waited = await observe(client.request("POST", "/b", json={}), mapping=map_answer)
            release.set()
            busy.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await busy
        finally:
            await client.aclose()
    assert (waited.transport, waited.error_class) == (
        Transport.NOT_SENT,
        "aiohttp.ConnectionTimeoutError",
    )
    assert verdict(waited) is Verdict.NOT_EXECUTED
    assert [h.split(b" ")[1] for h in heads] == [b"/a"]


async def test_a_redirect_is_an_answer_not_followed() -> None:
    async with serving(answering("302 Found", {"Location": "/elsewhere"})) as url:
        answer = await post(url)
    assert (answer.transport, answer.status) == (Transport.RESPONSE, 302)
    assert verdict(answer) is Verdict.UNKNOWN


async def test_503_with_retry_after() -> None:
    async with serving(answering("503 Service Unavailable", {"Retry-After": "2"})) as url:
        answer = await post(url)
    assert answer.transport is Transport.RESPONSE
    assert answer.status == 503
    assert answer.retry_after == ("2",)
    assert answer.provider_reference is None
    assert verdict(answer) is Verdict.UNKNOWN


async def test_every_retry_after_header_is_kept_raw() -> None:
    handler = answering("429 Too Many Requests", {"Retry-After": "1", "retry-after": "5"})
    async with serving(handler) as url:
        answer = await post(url)
    assert answer.status == 429
    assert answer.retry_after == ("1", "5")
    assert verdict(answer) is Verdict.NOT_EXECUTED


async def test_402_card_declined_error_code() -> None:
    document = {"error": {"type": "card_error", "code": "card_declined"}}
    async with serving(json_answer("402 Payment Required", document)) as url:
        answer = await post(url)
    assert answer.transport is Transport.RESPONSE
    assert answer.status == 402
    assert answer.error_code == "card_declined"
    assert answer.provider_reference is None
    assert answer.detail["body"] == document
    assert verdict(answer) is Verdict.FAILED


async def test_400_idempotency_error_type_is_a_key_conflict_end_to_end() -> None:
    # Stripe's idempotency_error carries only a type; observe falls back to it.
    document = {"error": {"type": "idempotency_error", "message": "Keys ... same parameters"}}
    async with serving(json_answer("400 Bad Request", document)) as url:
        answer = await post(url)
    assert answer.error_code == "idempotency_error"
    assert verdict(answer) is Verdict.KEY_CONFLICT


async def test_200_with_id_is_provider_reference() -> None:
    document = {"id": "ch_123", "status": "succeeded"}
    async with serving(json_answer("200 OK", document)) as url:
        answer = await post(url)
    assert answer.transport is Transport.RESPONSE
    assert answer.status == 200
    assert answer.provider_reference == "ch_123"
    assert answer.error_code is None
    assert answer.retry_after == ()
    assert verdict(answer) is Verdict.SUCCEEDED


async def test_non_json_body_is_kept_as_text() -> None:
    handler = answering("502 Bad Gateway", {"Content-Type": "text/html"}, b"<h1>bad gateway</h1>")
    async with serving(handler) as url:
        answer = await post(url)
    assert answer.status == 502
    assert answer.error_code is None
    assert answer.detail == {"body_text": "<h1>bad gateway</h1>"}
    assert verdict(answer) is Verdict.UNKNOWN


async def test_a_trickling_answer_is_cut_off_by_the_call_deadline() -> None:
    """Each read returns within the client's timeout, so only the total deadline ends it."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.close()

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = ProviderClient(4, f"http://127.0.0.1:{port}", timedelta(seconds=0.5))
        try:
            started = asyncio.get_running_loop().time()
            answer = await observe(client.request("GET", "/"), deadline=1.0)
            elapsed = asyncio.get_running_loop().time() - started
        finally:
            await client.aclose()
    finally:
        server.close()
    assert (answer.transport, answer.error_class) == (
        Transport.NO_RESPONSE,
        "builtins.TimeoutError",
    )
    assert elapsed < 3
