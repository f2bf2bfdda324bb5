"""The conformance kit: checks every provider adapter runs from its own tests.

Each check is a plain function taking what it needs: a migrated, otherwise
empty ledger database (`AsyncEngine`, on SQLite or PostgreSQL), the adapter
(a `Provider`, or a factory of one) and a description of what the kit cannot
guess (`Webhooks`, `SubmitAnswers`, a status table). No pytest fixture is
involved, so a plug-in's tests call them as they like:

    await check_kind(engine, webhooks)            # an event speaks only for its kind
    await check_webhook_verification(engine, webhooks)
    check_status_mapping(word_of, named)          # unnamed statuses are never outcomes
    check_submit_mapping(answers)                 # unnamed answers are never outcomes
    await check_transport(build, request)         # "never sent" only when it was not
    await check_lookup(engine, provider, consistency, retention)

and a short chaos run against the provider's fake, in intentledger.testing.chaos:

    await check_chaos(engine, fake, build, reader=..., consistency=..., retention=...)

The operations the checks need are made by the real engine (intake, then the
dispatcher) with a stand-in for the provider whose answers are lost, so they
wait UNKNOWN as after a timeout; the events go through the adapter's own
reader and the engine's `provider_events.receive`, as the webhook route sends
them. A failed check raises `ConformanceError` saying what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.retention import RetentionPolicy
from intentledger.domain.safety import SafetyRules
from intentledger.domain.signatures import SignatureRefused
from intentledger.domain.states import Outcome, State
from intentledger.domain.transport import (
    Classification,
    LookupAnswer,
    LookupVerdict,
    ProviderAnswer,
    Transport,
    Verdict,
    classify,
    judge_lookup,
    speaks_an_outcome,
)
from intentledger.engine import intake, provider_events
from intentledger.engine.cards import new_card_id, prepare_issue
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings
from intentledger.engine.reconciler import Reconciler, operation_lookup
from intentledger.engine.refunds import REFUND_ROUTE, accept_refund
from intentledger.ports import free_port
from intentledger.providers.base import (
    BatchWebhookReader,
    LookupConsistency,
    Provider,
    ProviderLookup,
    ProviderRequest,
    UnreadableEvent,
    WebhookEvent,
    WebhookReader,
    read_events,
)
from intentledger.providers.http import ProviderResponse, answer_of, call_deadline
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord

ACTOR = "conformance"
WORKER = "conformance-kit"
LEASE = timedelta(minutes=5)
# Far away: no check comes due while the kit delivers events (the lookup check
# moves its clock to one on purpose).
BACKOFF = timedelta(minutes=10)
AMOUNT = 500
# The operation kinds the kit makes, and the object kind each is spoken for by
# when the adapter is right.
PLANTED = {"payment": "payment", "refund": "refund", "card_issue": "card"}


class ConformanceError(AssertionError):
    """The adapter (or the ledger with it) broke one of the port's promises."""


def _fail(message: str) -> ConformanceError:
    return ConformanceError(message)


class _Clock:
    """The kit's clock: still unless a check moves it."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC).replace(microsecond=0)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, by: timedelta) -> None:
        self.now += by


# -- describing an adapter's webhooks ------------------------------------------------------------


@dataclass(frozen=True)
class EventAbout:
    """What one event the adapter's provider would send is about."""

    event_id: str
    object_kind: str  # payment | refund | card: the adapter gives it an id in its shape
    reference: str  # our operation id, where the provider's object carries it
    final: bool  # True: the object succeeded; False: it is still processing
    created: int  # unix seconds


# `body` signed with `secret` at a unix time, as the provider sends it: the body
# (changed, for a scheme that signs inside it) and the headers beside it.
Signer = Callable[[bytes, str, int], tuple[bytes, Mapping[str, str]]]


def signed_in_headers(headers: Callable[[bytes, str, int], Mapping[str, str]]) -> Signer:
    """A `Webhooks.sign` for a scheme that signs the raw body in a header
    (Stripe's, Standard Webhooks'): the body goes out unchanged beside
    `headers(body, secret, at)`."""

    def sign(body: bytes, secret: str, at: int) -> tuple[bytes, Mapping[str, str]]:
        return body, headers(body, secret, at)

    return sign


def respaced(body: bytes) -> bytes:
    """`body` with one space more: a change every signature over the raw body
    detects (the default `Webhooks.tamper`)."""
    return body.replace(b"}", b" }", 1) if b"}" in body else body + b" "


@dataclass(frozen=True)
class Webhooks:
    """What the kit needs of an adapter's webhooks. Two shapes of scheme fit:
    one that signs the raw body in a header with a timestamp (Stripe, the
    sandbox), and one that signs fields inside the body with no timestamp,
    several events to a body (Adyen's notification batches)."""

    provider: str  # the adapter's name: the provider its operations are sent to
    # Configured with `secrets`: a reader of one event per body, or of a batch
    # (`BatchWebhookReader`); the kit reads through either.
    reader: WebhookReader | BatchWebhookReader
    # Every secret the reader was configured with: the old and the new while rotating.
    secrets: tuple[str, ...]
    # How the provider signs (`signed_in_headers` wraps a header-only scheme).
    sign: Signer
    # The unsigned body of the provider's event about one object (for a batch
    # scheme, a batch of that one event).
    event: Callable[[EventAbout], bytes]
    # What its events can be about (a subset of payment, refund, card).
    object_kinds: frozenset[str]
    # How old (or how far ahead) a signature may be before the reader refuses
    # it. None: the scheme signs no time (Adyen's), so a replayed event verifies
    # for ever: the stale checks are skipped, and deduplication is wholly the
    # receiver's job (the duplicate check still runs).
    tolerance: timedelta | None
    # A change to a part of the signed body the signature covers, applied to
    # the body as signed. A scheme that signs the raw body detects any byte
    # (the default); one that signs a few fields (Adyen signs eight) detects
    # only a change to those, and the kit asks no more of it.
    tamper: Callable[[bytes], bytes] = respaced
    # Whether the provider sends an event about an object still processing
    # (EventAbout.final False). Adyen's notifications are outcomes only: without
    # one, the out-of-order check (an older, non-final event after the final
    # one) is skipped.
    non_final_events: bool = True


# -- making operations ---------------------------------------------------------------------------


class _StandIn:
    """The provider while the kit makes operations: every answer is lost after
    sending (the operation waits UNKNOWN), or, for the payment a refund reverses,
    a success naming a made-up charge."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.succeed = False

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        if self.succeed:
            return ProviderAnswer(
                Transport.RESPONSE,
                status=200,
                provider_reference=f"kit_{request.reference}",
                mapped=Classification(Verdict.SUCCEEDED, "the conformance kit's stand-in"),
            )
        return ProviderAnswer(Transport.NO_RESPONSE, error_class="conformance.AnswerLost")

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        raise ConformanceError("the kit's stand-in provider is never looked at")

    async def aclose(self) -> None:
        return None


class _Operations:
    """Makes operations at `provider` through the real intake and dispatcher."""

    def __init__(self, engine: AsyncEngine, provider: str, clock: Callable[[], datetime]) -> None:
        self.engine = engine
        self.clock = clock
        self.stand_in = _StandIn(provider)
        self.dispatcher = Dispatcher(
            engine,
            self.stand_in,
            clock,
            DispatchSettings(lease=LEASE, recheck_backoff=BACKOFF),
            WORKER,
            jitter=lambda: 0.0,
        )

    def _intent(self, route: str, kind: str, body: dict[str, Any]) -> intake.Intent:
        return intake.Intent(
            ACTOR,
            route,
            f"kit-{secrets.token_hex(8)}",
            request_hash(ACTOR, route, body),
            body,
            self.stand_in.name,
            kind=kind,
        )

    async def _deliver(self, result: intake.IntakeResult) -> str:
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            if result.held_row_id is not None:
                row = await ledger.get_outbox_row(result.held_row_id)
            else:
                row = await ledger.claim_outbox_row(self.clock(), LEASE, WORKER)
        if row is None or row.operation_id != result.operation_id:
            raise _fail(f"the kit could not send {result.operation_id} (is the database fresh?)")
        await self.dispatcher.deliver_submit(row)
        return result.operation_id

    async def payment(self, *, succeed: bool = False) -> str:
        body = {"amount": AMOUNT, "currency": "EUR", "payment_method": "pm_kit", "metadata": {}}
        intent = self._intent("POST /v1/payments", "payment", body)
        result = await intake.accept(self.engine, self.clock, intent, hold=(WORKER, LEASE))
        self.stand_in.succeed = succeed
        try:
            return await self._deliver(result)
        finally:
            self.stand_in.succeed = False

    async def refund(self) -> str:
        payment_id = await self.payment(succeed=True)
        intent = self._intent(REFUND_ROUTE, "refund", {"amount": AMOUNT, "metadata": {}})
        return await self._deliver(await accept_refund(self.engine, self.clock, intent, payment_id))

    async def card_issue(self) -> str:
        intent = self._intent("POST /v1/cards", "card_issue", {"label": None})
        result = await intake.accept(
            self.engine,
            self.clock,
            intent,
            prepare=prepare_issue(new_card_id(), None),
            hold=(WORKER, LEASE),
        )
        return await self._deliver(result)

    async def unknown(self, kind: str) -> str:
        """An operation of `kind` whose answer was lost: UNKNOWN, one attempt."""
        made = {"payment": self.payment, "refund": self.refund, "card_issue": self.card_issue}
        operation_id = await made[kind]()
        operation = await self.get(operation_id)
        if operation.state != State.UNKNOWN:
            raise _fail(f"the kit's {kind} {operation_id} is {operation.state}, not UNKNOWN")
        return operation_id

    async def get(self, operation_id: str) -> OperationRecord:
        async with self.engine.connect() as conn:
            operation = await Ledger(conn).get_operation(operation_id)
        assert operation is not None
        return operation

    async def event_observations(self, operation_id: str) -> int:
        async with self.engine.connect() as conn:
            return len(await Ledger(conn).observations_of_kind(operation_id, "provider_event"))


# -- delivering events ---------------------------------------------------------------------------


def _about(object_kind: str, reference: str, *, final: bool = True, created: int) -> EventAbout:
    return EventAbout(
        event_id=f"evt_kit_{secrets.token_hex(8)}",
        object_kind=object_kind,
        reference=reference,
        final=final,
        created=created,
    )


def _signed(
    webhooks: Webhooks,
    body: bytes,
    now: datetime,
    *,
    secret: str | None = None,
    signed_at: datetime | None = None,
) -> tuple[bytes, dict[str, str]]:
    """`body` signed as the provider signs it (by default with the newest
    secret, now), with the headers as the web framework hands them over: names
    in lower case."""
    at = int((signed_at or now).timestamp())
    sent, headers = webhooks.sign(body, secret or webhooks.secrets[-1], at)
    return sent, {name.lower(): value for name, value in headers.items()}


def _read(
    webhooks: Webhooks,
    body: bytes,
    now: datetime,
    *,
    secret: str | None = None,
    signed_at: datetime | None = None,
) -> WebhookEvent:
    """The adapter's reading of the one event in `body`, signed."""
    sent, headers = _signed(webhooks, body, now, secret=secret, signed_at=signed_at)
    events = read_events(webhooks.reader, sent, headers, now)
    if len(events) != 1:
        raise _fail(f"the reader read {len(events)} events from a body holding one")
    return events[0]


async def _deliver(
    engine: AsyncEngine,
    clock: Callable[[], datetime],
    webhooks: Webhooks,
    body: bytes,
    *,
    secret: str | None = None,
) -> tuple[WebhookEvent, provider_events.Receipt]:
    event = _read(webhooks, body, clock(), secret=secret)
    receipt = await provider_events.receive(engine, clock, webhooks.provider, event, BACKOFF)
    return event, receipt


# -- the kind check ------------------------------------------------------------------------------


async def check_kind(engine: AsyncEngine, webhooks: Webhooks) -> None:
    """An event about one kind of object never settles an operation of another
    kind: a payment's success names no refund or card of ours, and a refund's no
    payment. For each kind of object the adapter's events can be about and each
    kind of operation the kit makes (a payment, a refund, a card issue, all
    UNKNOWN), a signed, valid success event naming the operation by our
    reference is delivered. Where the kinds match it must settle the operation
    (so the check cannot pass by settling nothing); otherwise it must be
    stored as `wrong_kind`, recorded on no operation, and change nothing."""
    clock = _Clock()
    made = _Operations(engine, webhooks.provider, clock)
    created = int(clock().timestamp())
    problems = []
    for object_kind in sorted(webhooks.object_kinds):
        for operation_kind, spoken_for_by in PLANTED.items():
            operation_id = await made.unknown(operation_kind)
            about = _about(object_kind, operation_id, created=created)
            event, receipt = await _deliver(engine, clock, webhooks, webhooks.event(about))
            operation = await made.get(operation_id)
            said = (
                f"a signed {object_kind} success naming {operation_kind} {operation_id} "
                f"(disposition {receipt.disposition!r}, the operation {operation.state}"
                f"{' ' + operation.outcome if operation.outcome else ''})"
            )
            if event.object_kind != object_kind:
                problems.append(f"{said}: the reader says it is about {event.object_kind!r}")
            elif object_kind == spoken_for_by:
                if (operation.state, operation.outcome) != (State.OUTCOME_KNOWN, Outcome.SUCCEEDED):
                    problems.append(f"{said}: the right kind of event must settle it")
            elif operation.state != State.UNKNOWN or await made.event_observations(operation_id):
                problems.append(f"{said}: an event about another kind of object changed it")
            elif receipt.disposition != "wrong_kind":
                problems.append(f"{said}: it must be stored as wrong_kind")
    if problems:
        raise _fail("; ".join(problems))


# -- the mapping property ------------------------------------------------------------------------

# Statuses an unnamed status is most easily mistaken for: the outcome words
# themselves, in the spellings a provider might use.
TEMPTING = (
    "succeeded",
    "success",
    "successful",
    "paid",
    "completed",
    "failed",
    "failure",
    "canceled",
    "cancelled",
    "declined",
    "refused",
    "authorised",
    "authorized",
    "approved",
    "captured",
    "settled",
    "rejected",
    "error",
    "Succeeded",
    "SUCCEEDED",
    "Failed",
    "FAILED",
    "Canceled",
    "Cancelled",
    "Declined",
    "Authorized",
    "AUTHORISED",
    "Refused ",
    "succeeded ",
    " failed",
    "",
    "None",
    "null",
)
# Error codes an unnamed code is most easily mistaken for: the ones providers use.
TEMPTING_CODES = (
    "card_declined",
    "card_error",
    "invalid_request_error",
    "idempotency_error",
    "idempotency_key_in_use",
    "rate_limit",
    "api_error",
    "authentication_error",
    "validation",
    "security",
    "000",
    "010",
    "167",
    "702",
    "704",
    "901",
)


def check_status_mapping(
    word_of: Callable[[str], str | None], named: Mapping[str, str], *, examples: int = 300
) -> None:
    """The adapter's mapping of its provider's status to the lookup's words
    (`word_of`: a lookup's reading of an object in that status, or a webhook
    reader's) gives each status its table names (`named`) its word, and any
    other status — generated, and the outcome words in other spellings — a
    word that is neither success nor failure (domain/transport.py,
    `speaks_an_outcome`): what the table does not name proves nothing."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    for status, word in named.items():
        if word_of(status) != word:
            raise _fail(f"status {status!r} reads as {word_of(status)!r}, the table says {word!r}")

    unnamed = st.one_of(st.sampled_from(TEMPTING), st.text(max_size=30)).filter(
        lambda status: status not in named
    )

    @settings(
        max_examples=examples,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.filter_too_much],
    )
    @given(unnamed)
    def unnamed_is_no_outcome(status: str) -> None:
        word = word_of(status)
        if speaks_an_outcome(word):
            raise _fail(f"status {status!r}, which the table does not name, reads as {word!r}")

    unnamed_is_no_outcome()


# What a submit's answer may never be for what its table does not name.
OUTCOMES = frozenset({Verdict.SUCCEEDED, Verdict.FAILED})


@dataclass(frozen=True)
class SubmitAnswers:
    """How an adapter reads its provider's answers to one kind of write."""

    # The adapter's reading of a response: the `mapping` it hands `observe`.
    mapping: Callable[[ProviderAnswer], Classification]
    # The JSON body of a 2xx answer whose object is in `word` (the status or
    # result code the table reads there).
    accepted: Callable[[str], Any]
    # The JSON body of an error answer carrying `code` (the error code or type
    # the table reads there).
    refused: Callable[[str], Any]
    # What the table names, by HTTP status: the words (2xx) or codes (an error)
    # it names at that status, or None when it maps the status whatever the body
    # says (a 429, a 5xx). A status absent here is one it does not name at all.
    named: Mapping[int, frozenset[str] | None]


def check_submit_mapping(answers: SubmitAnswers, *, examples: int = 300) -> None:
    """The adapter's mapping of a submit's answer never says succeeded or
    failed for an answer its table does not name: an HTTP status it does not
    name (any in 200-599), or at a status it names word by word, a status word
    or error code it does not name (generated, and the outcome words and
    common error codes in other spellings), or a body that is no JSON at all.
    Each answer is read as `observe` reads one off the wire
    (providers/http.py, `answer_of`), then mapped; a mapping that raises fails
    too."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    named = answers.named
    words = sorted({word for named_here in named.values() if named_here for word in named_here})
    statuses = st.one_of(st.sampled_from(sorted(named) or [200]), st.integers(200, 599))
    spoken = st.one_of(st.sampled_from((*TEMPTING, *TEMPTING_CODES, *words)), st.text(max_size=30))
    bodies = st.one_of(
        spoken.map(lambda word: ("word", word)),
        st.binary(max_size=40).map(lambda raw: ("raw", raw)),
    )

    def is_named(status: int, body: tuple[str, Any]) -> bool:
        if status not in named:
            return False
        named_here = named[status]
        return named_here is None or (body[0] == "word" and body[1] in named_here)

    @settings(
        max_examples=examples,
        database=None,
        derandomize=True,
        deadline=None,
        suppress_health_check=[HealthCheck.filter_too_much],
    )
    @given(statuses, bodies)
    def unnamed_is_no_outcome(status: int, body: tuple[str, Any]) -> None:
        if is_named(status, body):
            return
        kind, said = body
        if kind == "word":
            shape = answers.accepted if 200 <= status < 300 else answers.refused
            content = json.dumps(shape(said)).encode()
        else:
            content = said
        response = ProviderResponse(status, CIMultiDictProxy(CIMultiDict()), content)
        what = f"an answer {status} " + (
            f"with {said!r}, which the table does not name there"
            if kind == "word"
            else f"with the body {content!r}"
        )
        try:
            mapped = answer_of(response, mapping=answers.mapping).mapped
        except Exception as exc:
            raise _fail(f"{what}: the mapping raised {type(exc).__name__}: {exc}") from exc
        if mapped is not None and mapped.verdict in OUTCOMES:
            raise _fail(f"{what}, is mapped {mapped.verdict} ({mapped.reason})")

    unnamed_is_no_outcome()


# -- webhook verification ------------------------------------------------------------------------


async def check_webhook_verification(engine: AsyncEngine, webhooks: Webhooks) -> None:
    """The reader refuses a forged event (signed with another secret, changed
    after signing where the signature covers it, not signed at all) and, for a
    scheme that signs a time, a stale one (signed longer ago than its
    tolerance, or as far ahead); accepts every configured secret (the old and
    the new while rotating); and the ledger takes a duplicate delivery once
    and, where the provider sends non-final events, an older event delivered
    after a newer one as a record that changes nothing."""
    clock = _Clock()
    now = clock()
    made = _Operations(engine, webhooks.provider, clock)
    object_kind = "payment" if "payment" in webhooks.object_kinds else min(webhooks.object_kinds)
    operation_kind = next(k for k, spoken in PLANTED.items() if spoken == object_kind)
    operation_id = await made.unknown(operation_kind)
    created = int(now.timestamp())
    body = webhooks.event(_about(object_kind, operation_id, created=created))

    problems = []
    sent, headers = _signed(webhooks, body, now)
    tampered = webhooks.tamper(sent)
    if tampered == sent:
        problems.append("the description's tamper changed nothing in the signed body")
    # 64 hex digits: a secret of the shape every scheme we know takes.
    another = secrets.token_hex(32)
    refusals: dict[str, Callable[[], object]] = {
        "signed with another secret": lambda: _read(webhooks, body, now, secret=another),
        "changed after signing": lambda: read_events(webhooks.reader, tampered, headers, now),
        "not signed": lambda: read_events(webhooks.reader, body, {}, now),
    }
    if webhooks.tolerance is not None:
        tolerance = webhooks.tolerance
        refusals["signed too long ago"] = lambda: _read(
            webhooks, body, now, signed_at=now - tolerance - timedelta(seconds=1)
        )
        refusals["signed too far ahead"] = lambda: _read(
            webhooks, body, now, signed_at=now + tolerance + timedelta(seconds=1)
        )
    for what, read in refusals.items():
        try:
            read()
        except SignatureRefused:
            continue
        except UnreadableEvent as exc:
            problems.append(f"an event {what} was refused as unreadable, not as forged: {exc}")
            continue
        problems.append(f"an event {what} was accepted")
    for secret in webhooks.secrets:
        try:
            _read(webhooks, body, now, secret=secret)
        except SignatureRefused as exc:
            problems.append(f"an event signed with a configured secret was refused: {exc}")
    if problems:
        raise _fail("; ".join(problems))

    first_event, first = await _deliver(engine, clock, webhooks, body)
    _, again = await _deliver(engine, clock, webhooks, body, secret=webhooks.secrets[0])
    distinct = 1
    if webhooks.non_final_events:
        older = webhooks.event(_about(object_kind, operation_id, final=False, created=created - 60))
        _, late = await _deliver(engine, clock, webhooks, older)
        distinct = 2
        if late.duplicate or late.disposition != "recorded":
            problems.append(f"an older event delivered late was {late.disposition}, not recorded")
    operation = await made.get(operation_id)
    seen = await made.event_observations(operation_id)
    if first.disposition != "applied" or first.duplicate:
        problems.append(f"the first delivery was {first.disposition} (duplicate {first.duplicate})")
    if not again.duplicate or again.event_id != first_event.event_id:
        problems.append("a second delivery of the same event was not taken as a duplicate")
    if (operation.state, operation.outcome) != (State.OUTCOME_KNOWN, Outcome.SUCCEEDED):
        problems.append(f"the operation ended {operation.state} {operation.outcome}")
    if operation.outcome_contradicted or operation.duplicate_detected:
        problems.append("a duplicate or late event raised a flag")
    if seen != distinct:
        problems.append(f"{seen} observations, not one per distinct event ({distinct})")
    if problems:
        raise _fail("; ".join(problems))


# -- "never sent" ---------------------------------------------------------------------------------

TRANSPORT_TIMEOUT = timedelta(milliseconds=500)
# How much longer than its own deadline a submit may take before the kit gives up on it.
SUBMIT_SLACK = timedelta(seconds=3)


class _Listener:
    """A server on a loopback port that reads each request whole and then
    hangs up (`close`: an orderly close; `reset`: a TCP reset) or says nothing
    until the client gives up (`silent`). Its port is the kernel's choice,
    taken by binding: nothing can take it between the choice and the bind."""

    def __init__(self, manner: str) -> None:
        self.manner = manner
        self.requests = 0
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> _Listener:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()
        await asyncio.sleep(0)  # let each handler see its connection closed

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(_content_length(head))
            self.requests += 1
            if self.manner == "reset":
                # No lingering: closing sends a reset, not an orderly end.
                connection = writer.get_extra_info("socket")
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif self.manner == "silent":
                await reader.read()  # until the client gives up and closes
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


async def _submit_once(
    build: Callable[[str, timedelta], Provider],
    api_base: str,
    call_timeout: timedelta,
    request: ProviderRequest,
) -> ProviderAnswer | str:
    """The adapter's answer to one submit, or what went wrong instead of one."""
    provider = build(api_base, call_timeout)
    limit = (call_deadline(call_timeout) + SUBMIT_SLACK).total_seconds()
    try:
        async with asyncio.timeout(limit):
            return await provider.submit(request)
    except TimeoutError:
        return f"did not return within {limit:.1f} s"
    except Exception as exc:
        return f"raised {type(exc).__name__} ({exc}): a submit never raises for transport trouble"
    finally:
        await provider.aclose()


async def check_transport(
    build: Callable[[str, timedelta], Provider],
    request: ProviderRequest,
    *,
    call_timeout: timedelta = TRANSPORT_TIMEOUT,
) -> None:
    """Transport trouble is classified by what can have happened, never as an
    outcome. `build(api_base, call_timeout)` makes the adapter against a server at
    `api_base` (`http://127.0.0.1:<port>`, no path: the factory adds any prefix
    its provider needs) with `call_timeout` for each phase of a call; `request` is a
    write it carries (a sample payment, a refund with its target...). On real
    loopback sockets, no mocks:

    - nothing listens on the port (the connection is refused): the submit's
      answer is NOT_EXECUTED, never sent;
    - a server reads the request and closes the connection without answering,
      or resets it, or never answers within `call_timeout`: UNKNOWN, no response
      (the request may have been executed) — never FAILED, never "not sent".

    Each submit must return, not raise, within its deadline and a little more."""
    problems = []

    def judged(answer: ProviderAnswer | str, case: str, wanted: Verdict) -> None:
        if isinstance(answer, str):
            problems.append(f"{case}: the submit {answer}")
            return
        verdict = classify(answer).verdict
        transport = Transport.NOT_SENT if wanted is Verdict.NOT_EXECUTED else Transport.NO_RESPONSE
        if verdict is not wanted or answer.transport is not transport:
            problems.append(
                f"{case}: the answer is {verdict} ({answer.transport}, {answer.error_class}), "
                f"not {wanted} ({transport})"
            )

    refused = f"http://127.0.0.1:{free_port()}"  # below the ephemeral range: nobody there
    judged(
        await _submit_once(build, refused, call_timeout, request),
        "a connection refused",
        Verdict.NOT_EXECUTED,
    )
    cases = {
        "close": "a server that read the request and closed the connection",
        "reset": "a server that read the request and reset the connection",
        "silent": f"a server that read the request and did not answer within {call_timeout}",
    }
    for manner, case in cases.items():
        async with _Listener(manner) as listener:
            base = f"http://127.0.0.1:{listener.port}"
            answer = await _submit_once(build, base, call_timeout, request)
        if listener.requests == 0:
            problems.append(f"{case}: the adapter sent no request to it ({answer!r})")
            continue
        judged(answer, case, Verdict.UNKNOWN)
    if problems:
        raise _fail("; ".join(problems))


# -- the lookup's consistency --------------------------------------------------------------------


class _Watched:
    """The adapter, with every lookup it is asked counted."""

    def __init__(self, provider: Provider) -> None:
        self.provider = provider
        self.name = provider.name
        self.lookups = 0

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        return await self.provider.submit(request)

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        self.lookups += 1
        return await self.provider.lookup(query)

    async def aclose(self) -> None:
        await self.provider.aclose()


async def check_lookup(
    engine: AsyncEngine,
    provider: Provider,
    consistency: LookupConsistency,
    retention: RetentionPolicy,
) -> None:
    """The adapter's lookup keeps its plug-in's declaration (`consistency`,
    what `ProviderPlugin.consistency` gives; `retention`, its `retention`).
    `provider` is the adapter against a provider (a fake) that has never seen
    the kit's operations. The kit makes a payment whose answer was lost
    (UNKNOWN, sent just now) and:

    - with a lookup declared eventually consistent (`lag`): the adapter's
      lookup of it finds nothing and carries a lag no shorter than the declared
      one, so the funnel judges it NOT_YET_VISIBLE right after the send and
      anywhere inside the declared lag (inconclusive, not NOT_FOUND), and
      NOT_FOUND once the lag has passed;
    - with a strongly consistent lookup (no lag): its "nothing found" is
      NOT_FOUND at once;
    - with no lookup (`available` False): the reconciler's check of the payment
      never asks the adapter (it records `no_lookup` and leaves the operation
      unsettled for the safety review), and the adapter's lookup, if called
      anyway, says so: it raises, or answers nothing the funnel reads as
      evidence (`no_lookup`, or a failed lookup), never "not found"."""
    clock = _Clock()
    made = _Operations(engine, provider.name, clock)
    operation_id = await made.unknown("payment")
    operation = await made.get(operation_id)
    async with engine.connect() as conn:
        ledger = Ledger(conn)
        # The read the reconciler would make, and the send it would measure from.
        query = await operation_lookup(ledger, operation)
        last = await ledger.last_attempt(operation_id)
    assert last is not None
    if consistency.available:
        await _lookup_inside_lag(provider, consistency, query, last.submitted_at)
    else:
        await _never_looked_up(engine, made, clock, provider, retention, query)


async def _lookup_inside_lag(
    provider: Provider, consistency: LookupConsistency, query: ProviderLookup, sent_at: datetime
) -> None:
    try:
        lookup = await provider.lookup(query)
    except Exception as exc:
        raise _fail(
            f"the lookup of {query.reference} raised {type(exc).__name__} ({exc}): a plug-in "
            "whose provider cannot be looked up declares LookupConsistency(available=False)"
        ) from exc
    right_after = judge_lookup(lookup, sent_at, sent_at + timedelta(seconds=1))
    said = f"a lookup of {query.reference}, which the provider never saw, right after its send"
    if right_after.verdict is LookupVerdict.LOOKUP_FAILED:
        raise _fail(f"{said}: {right_after.reason} (the kit needs a provider that answers)")
    if lookup.charges:
        raise _fail(f"{said} found {[c.provider_reference for c in lookup.charges]}")
    if consistency.lag is None:
        if right_after.verdict is not LookupVerdict.NOT_FOUND:
            raise _fail(
                f"{said}: judged {right_after.verdict} ({right_after.reason}); the plug-in "
                "declares a strongly consistent lookup, whose absence is NOT_FOUND"
            )
        return
    problems = []
    if lookup.lag is None or lookup.lag < consistency.lag:
        problems.append(
            f"{said}: the answer carries lag {lookup.lag}, the plug-in declares {consistency.lag}"
        )
    inside = max(consistency.lag - timedelta(seconds=1), timedelta(0))
    for after in sorted({timedelta(seconds=1), inside}):
        judged = judge_lookup(lookup, sent_at, sent_at + after)
        if judged.verdict is not LookupVerdict.NOT_YET_VISIBLE:
            problems.append(
                f"nothing found {after} after the send, inside the declared lag "
                f"{consistency.lag}: judged {judged.verdict} ({judged.reason}), not "
                f"{LookupVerdict.NOT_YET_VISIBLE}"
            )
    if lookup.lag is not None:
        past = judge_lookup(lookup, sent_at, sent_at + lookup.lag + timedelta(seconds=1))
        if past.verdict is not LookupVerdict.NOT_FOUND:
            problems.append(f"nothing found past the lag: judged {past.verdict} ({past.reason})")
    if problems:
        raise _fail("; ".join(problems))


async def _never_looked_up(
    engine: AsyncEngine,
    made: _Operations,
    clock: _Clock,
    provider: Provider,
    retention: RetentionPolicy,
    query: ProviderLookup,
) -> None:
    watched = _Watched(provider)
    reconciler = Reconciler(
        engine,
        watched,
        clock,
        BACKOFF,
        lambda _provider: retention,
        lambda _provider: SafetyRules(),
        WORKER,
        jitter=lambda: 0.0,
        has_lookup=False,
    )
    # To when the check of the lost answer is due, as a worker would wait.
    due = (await made.get(query.reference)).retry_after_at
    if due is not None and due > clock():
        clock.advance(due - clock())
    async with engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(clock(), LEASE, WORKER)
    if row is None or row.kind != "reconcile" or row.operation_id != query.reference:
        raise _fail(f"no check of {query.reference} came due (is the database fresh?)")
    await reconciler.deliver_reconcile(row)
    problems = []
    if watched.lookups:
        problems.append(f"the reconciler asked the adapter's lookup {watched.lookups} times")
    async with engine.connect() as conn:
        checks = await Ledger(conn).observations_of_kind(query.reference, "lookup_result")
    verdicts = [check.verdict for check in checks]
    if verdicts != [LookupVerdict.NO_LOOKUP]:
        problems.append(f"the check recorded {verdicts}, not [{LookupVerdict.NO_LOOKUP}]")
    operation = await made.get(query.reference)
    if operation.state == State.OUTCOME_KNOWN:
        problems.append(f"a check that asked nothing settled the payment {operation.outcome}")
    try:
        asked_anyway = await provider.lookup(query)
    except Exception:
        asked_anyway = None  # it refuses to look: it says so
    if asked_anyway is not None:
        verdict = judge_lookup(asked_anyway, clock(), clock()).verdict
        if verdict not in (LookupVerdict.NO_LOOKUP, LookupVerdict.LOOKUP_FAILED):
            problems.append(
                f"the plug-in declares no lookup, yet its lookup answered (judged {verdict})"
            )
    if problems:
        raise _fail("; ".join(problems))
