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
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import web
from hypothesis import example, given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.transport import (
    ERROR_CLASS_WIDTH,
    REFERENCE_WIDTH,
    ChargeSeen,
    ProviderAnswer,
    Transport,
)
from intentledger.engine import intake
from intentledger.engine.cards import new_card_id, prepare_issue
from intentledger.engine.intake import Intent
from intentledger.providers import adyen, stripe
from intentledger.providers.base import (
    EVENT_ID_WIDTH,
    EVENT_TYPE_WIDTH,
    UnreadableEvent,
    WebhookEvent,
    read_event_json,
)
from intentledger.providers.http import (
    MAX_ANSWER_DEPTH,
    ProviderClient,
    ProviderResponse,
    answer_of,
    redacted,
    storable_text,
)
from intentledger.store.ledger import Ledger
from intentledger.store.tables import (
    cards,
    observations,
    observations_with_detail,
    operations,
    provider_events,
)
from tests.conftest import free_port
from tests.test_dispatch import MovableClock, accept, make_worker, operation, rows

CARD_ROUTE = "POST /v1/cards"

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
    "a number no double holds": (
        b'{"id": "ch_1", "status": "succeeded", "fee": 1e400, "rate": -2.5e-3}',
        lambda body: [body["fee"], body["rate"]],
        ["1e400", -0.0025],
    ),
    "UTF-16 with no byte-order mark": (
        # Every byte ASCII, and no `\u` in them: its NUL bytes say it is not UTF-8.
        '{"id": "ch_1", "status": "succeeded", "description": "a\\u0000b"}'.encode("utf-16-le"),
        lambda body: body["description"],
        "a\ufffdb",
    ),
    "a NUL in the reference": (
        b'{"id": "ch_\\u0000", "status": "succeeded"}',
        lambda body: body["id"],
        "ch_\ufffd",
    ),
}


async def provider_answering(
    status: int, body: bytes, path: str = "/v1/charges"
) -> AsyncIterator[str]:
    async def write(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post(path, write)
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


async def test_a_reference_longer_than_the_ledger_keeps_is_kept_cut_to_its_width(
    engine: AsyncEngine,
) -> None:
    # PostgreSQL refuses a value wider than its column, where SQLite keeps it.
    long_id = "ch_" + "x" * 300
    body = json.dumps({"id": long_id, "status": "succeeded"}).encode()
    operation_id, observed = await deliver_once(engine, 200, body)
    settled = await operation(engine, operation_id)
    assert (settled.state, settled.outcome) == ("OUTCOME_KNOWN", "succeeded")
    assert settled.provider_reference == observed.provider_reference == long_id[:REFERENCE_WIDTH]


async def test_a_card_the_provider_names_with_the_widest_reference_is_issued(
    engine: AsyncEngine,
) -> None:
    # A card's provider id had a column of 64 characters: on PostgreSQL an issue
    # answered with a longer id could not be recorded, and the card stayed
    # pending, its issue SUBMITTING, at every look.
    clock = MovableClock()
    card_id = new_card_id()
    body = {"label": "travel"}
    intent = Intent(
        actor="alice",
        route=CARD_ROUTE,
        idempotency_key=f"card-{card_id}",
        request_hash=request_hash("alice", CARD_ROUTE, body),
        body=body,
        provider="sandbox",
        kind="card_issue",
    )
    accepted = await intake.accept(engine, clock, intent, prepare=prepare_issue(card_id, "travel"))
    operation_id = str(accepted.operation["operation_id"])
    long_id = "ic_" + "c" * 300
    answer = json.dumps({"id": long_id, "status": "active"}).encode()
    async for url in provider_answering(200, answer, path="/v1/cards"):
        worker = make_worker(engine, url, clock)
        assert await worker.deliver_batch(limit=10) == 1
    issued = await operation(engine, operation_id)
    assert (issued.state, issued.outcome) == ("OUTCOME_KNOWN", "succeeded")
    async with engine.connect() as conn:
        card = await Ledger(conn).get_card(card_id)
    assert card is not None
    assert (card.status, card.provider_card_id) == ("active", long_id[:REFERENCE_WIDTH])


class AnAdapterLibrarysExceptionForAConnectionLostAfterTheRequestWasWritten(Exception):
    """What a plug-in adapter's library may raise: a qualified name wider than
    the ledger's column for it."""


async def test_an_error_class_wider_than_the_ledger_keeps_is_recorded_cut(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def lost(*args: Any, **kwargs: Any) -> Any:
        raise AnAdapterLibrarysExceptionForAConnectionLostAfterTheRequestWasWritten("lost")

    monkeypatch.setattr(ProviderClient, "request", lost)
    clock = MovableClock()
    operation_id = await accept(engine, clock, "pm_ok")
    worker = make_worker(engine, f"http://127.0.0.1:{free_port()}", clock)
    assert await worker.deliver_batch(limit=10) == 1
    # No response: UNKNOWN, with what the call raised kept to the column's width.
    assert (await operation(engine, operation_id)).state == "UNKNOWN"
    (observed,) = await rows(engine, observations_with_detail, operation_id)
    qualified = (
        "tests." + AnAdapterLibrarysExceptionForAConnectionLostAfterTheRequestWasWritten.__name__
    )
    assert len(qualified) > ERROR_CLASS_WIDTH
    assert observed.error_class == qualified[:ERROR_CLASS_WIDTH]


def test_the_reference_width_is_every_reference_column_s_and_a_look_s_too() -> None:
    columns = [
        operations.c.provider_reference,
        observations.c.provider_reference,
        provider_events.c.object_id,
        provider_events.c.reference,
        cards.c.provider_card_id,
    ]
    assert {column.type.length for column in columns} == {REFERENCE_WIDTH}
    seen = ChargeSeen("ch_" + "y" * 300, "succeeded")
    assert seen.provider_reference == ("ch_" + "y" * 300)[:REFERENCE_WIDTH]
    answer = replace(ProviderAnswer(Transport.RESPONSE, status=200), provider_reference="z" * 256)
    assert answer.provider_reference == "z" * REFERENCE_WIDTH
    # And the error class's.
    assert observations.c.error_class.type.length == ERROR_CLASS_WIDTH
    lost = ProviderAnswer(Transport.NO_RESPONSE, error_class="e" * (ERROR_CLASS_WIDTH + 1))
    assert lost.error_class == "e" * ERROR_CLASS_WIDTH


def test_an_event_any_reader_makes_is_kept_to_its_columns() -> None:
    # Whatever a reader makes, a plug-in's too, is stored: a longer value,
    # refused by PostgreSQL, answered every redelivery with an error.
    assert provider_events.c.event_id.type.length == EVENT_ID_WIDTH
    assert provider_events.c.type.type.length == EVENT_TYPE_WIDTH
    event = WebhookEvent(
        event_id="evt_" + "e" * 300,
        type="charge." + "t" * 200,
        signed_at=datetime(2026, 12, 7, tzinfo=UTC),
        object_id="ch_" + "o" * 300,
        reference="op_" + "r" * 300,
        status="succeeded",
        payload={},
    )
    assert (len(event.event_id), len(event.type)) == (EVENT_ID_WIDTH, EVENT_TYPE_WIDTH)
    assert event.object_id == ("ch_" + "o" * 300)[:REFERENCE_WIDTH]
    assert event.reference == ("op_" + "r" * 300)[:REFERENCE_WIDTH]
    # The event id is what a redelivery is known by: kept unique, not cut alike.
    # Two ids that share their first 255 characters stay two, each its own
    # whenever it is delivered.
    twin = replace(event, event_id="evt_" + "e" * 299 + "f")
    assert len(twin.event_id) == EVENT_ID_WIDTH and twin.event_id != event.event_id
    assert event.event_id.startswith("evt_eee") and replace(event).event_id == event.event_id
    assert replace(event, event_id="evt_" + "e" * 300).event_id == event.event_id
    plain = WebhookEvent("evt_1", "charge.succeeded", event.signed_at, None, None, None, {})
    assert (plain.event_id, plain.type, plain.object_id, plain.reference) == (
        "evt_1",
        "charge.succeeded",
        None,
        None,
    )
    # A plug-in's integer id is read as the built-in readers make every id: text.
    numbered = WebhookEvent(12345, "charge.succeeded", event.signed_at, 67, None, None, {})  # type: ignore[arg-type]
    assert (numbered.event_id, numbered.object_id) == ("12345", "67")


@pytest.mark.parametrize(
    "body",
    [
        # JSON the reference path records: a refusal judged on its own, not settled in a group.
        b'{"error": {"type": "api_error", "message": "a\\u0000b", "code": NaN, "at": 1e999}}',
        # A success nested deeper than Python reads: kept as text, judged unreadable.
        b'{"id": "ch_1", "status": "succeeded", "a": ' * 5_000 + b"1" + b"}" * 5_000,
    ],
    ids=["a refusal's JSON", "a success too deep to read"],
)
async def test_an_answer_for_the_reference_path_is_recorded_whatever_it_holds(
    engine: AsyncEngine, body: bytes
) -> None:
    status = 503 if body.startswith(b'{"error"') else 200
    operation_id, observed = await deliver_once(engine, status, body)
    assert (await operation(engine, operation_id)).state != "SUBMITTING"
    assert observed.http_status == status
    detail = observed.detail if isinstance(observed.detail, dict) else json.loads(observed.detail)
    if status == 503:
        assert detail["body"]["error"] == {
            "type": "api_error",
            "message": "a\ufffdb",
            "code": "NaN",
            "at": "1e999",
        }
    else:
        assert detail["body_text"] == body[:2000].decode()


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


# -- the class: any body, any encoding, any header -------------------------------------------

# What a database refuses, beside what it keeps, and what JSON must escape.
CHARACTERS = st.sampled_from(["a", "é", "😀", "\x00", "\ud800", "\udfff", '"', "\\"])
TEXT = st.lists(CHARACTERS, max_size=4).map("".join)
NUMBERS = st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
VALUES = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=30,
)
# JSON's encodings as Python's parser reads them from bytes (it finds UTF-16
# and UTF-32 by their NUL bytes or a byte-order mark), escaped or written raw.
ENCODINGS = st.sampled_from(["escaped", "utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32"])


def body_of(value: Any, encoding: str) -> bytes:
    if encoding == "escaped":
        return json.dumps(value).encode()
    return json.dumps(value, ensure_ascii=False).encode(encoding, "surrogatepass")


def unstorable(value: Any) -> bool:
    """Whether `value` holds what a database of ours refuses."""
    if isinstance(value, str):
        return "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(unstorable(k) or unstorable(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(unstorable(item) for item in value)
    return False


def read(status: int, content: bytes, retry_after: str | None = None) -> Any:
    headers: CIMultiDict[str] = CIMultiDict()
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return answer_of(ProviderResponse(status, CIMultiDictProxy(headers), content))


@example(value={"d": "\x00"}, encoding="utf-16-le", status=200, retry_after=None)
@given(
    value=VALUES,
    encoding=ENCODINGS,
    status=st.sampled_from([200, 402, 503]),
    retry_after=st.none() | TEXT,
)
def test_every_answer_reads_as_what_every_database_stores(
    value: Any, encoding: str, status: int, retry_after: str | None
) -> None:
    answer = read(status, body_of(value, encoding), retry_after)
    recorded = (answer.detail, answer.provider_reference, answer.error_code, answer.retry_after)
    assert not unstorable(recorded)
    # And only that is replaced: a body with none of it is kept as it was parsed.
    if not unstorable(value):
        assert answer.detail["body"] == redacted(value)


@given(content=st.binary(max_size=64), status=st.sampled_from([200, 503]))
def test_any_bytes_read_as_what_every_database_stores(content: bytes, status: int) -> None:
    assert not unstorable(read(status, content).detail)


@pytest.mark.parametrize("depth", [10, MAX_ANSWER_DEPTH, MAX_ANSWER_DEPTH + 1, 500, 990, 100_000])
def test_a_body_nested_deeper_than_answers_are_read_is_kept_as_text(depth: int) -> None:
    # Every walk after the reading recurses (the redaction, an adapter's, the
    # writers' JSON): a body a few hundred levels deep ran them out of stack,
    # and nobody could record its answer. One deeper than the bound is text.
    content = b'{"id": "ch_1", "a": ' * depth + b"1" + b"}" * depth
    answer = read(200, content)
    if depth <= MAX_ANSWER_DEPTH:
        assert answer.provider_reference == "ch_1" and "body_text" not in answer.detail
    else:
        assert answer.detail == {"body_text": content[:2000].decode()}
        assert answer.provider_reference is None
    # What an adapter and a writer then do with it runs, however deep the body.
    for adapter in (stripe, adyen):
        adapter.recordable(answer, "sk_test_key")
    json.dumps(answer.detail)


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "evt_1", "fee": NaN}',
        b'{"id": "evt_1", "fee": 1e400}',
        b'{"id": "evt_\\ud800"}',
        b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    ],
    ids=["NaN", "overflow", "lone surrogate", "too deep"],
)
def test_an_event_no_database_of_ours_stores_is_unreadable(body: bytes) -> None:
    # The edge refuses all but the lone surrogate before a reader sees them (and
    # a NUL, which only it refuses); a reader refuses them all the same.
    with pytest.raises(UnreadableEvent):
        read_event_json(body)
