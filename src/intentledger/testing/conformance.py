"""The conformance kit: checks every provider adapter runs from its own tests.

Each check is a plain function taking what it needs: a migrated, otherwise
empty ledger database (`AsyncEngine`, on SQLite or PostgreSQL) and a
description of the adapter (`Webhooks`, or a mapping function and its table).
No pytest fixture is involved, so a plug-in's tests call them as they like:

    await check_kind(engine, webhooks)            # an event speaks only for its kind
    await check_webhook_verification(engine, webhooks)
    check_status_mapping(word_of, named)          # unnamed statuses are never outcomes

The operations the checks need are made by the real engine (intake, then the
dispatcher) with a stand-in for the provider whose answers are lost, so they
wait UNKNOWN as after a timeout; the events go through the adapter's own
reader and the engine's `provider_events.receive`, as the webhook route sends
them. A failed check raises `ConformanceError` saying what was wrong.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.signatures import SignatureRefused
from intentledger.domain.states import Outcome, State
from intentledger.domain.transport import (
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
    speaks_an_outcome,
)
from intentledger.engine import intake, provider_events
from intentledger.engine.cards import new_card_id, prepare_issue
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings
from intentledger.engine.refunds import REFUND_ROUTE, accept_refund
from intentledger.providers.base import (
    ProviderLookup,
    ProviderRequest,
    WebhookEvent,
    WebhookReader,
)
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord

ACTOR = "conformance"
WORKER = "conformance-kit"
LEASE = timedelta(minutes=5)
BACKOFF = timedelta(minutes=10)  # far away: nothing the kit sees is a scheduled check
AMOUNT = 500
# The operation kinds the kit makes, and the object kind each is spoken for by
# when the adapter is right.
PLANTED = {"payment": "payment", "refund": "refund", "card_issue": "card"}


class ConformanceError(AssertionError):
    """The adapter (or the ledger with it) broke one of the port's promises."""


@dataclass(frozen=True)
class EventAbout:
    """What one event the adapter's provider would send is about."""

    event_id: str
    object_kind: str  # payment | refund | card: the adapter gives it an id in its shape
    reference: str  # our operation id, where the provider's object carries it
    final: bool  # True: the object succeeded; False: it is still processing
    created: int  # unix seconds


@dataclass(frozen=True)
class Webhooks:
    """What the kit needs of an adapter's webhooks."""

    provider: str  # the adapter's name: the provider its operations are sent to
    reader: WebhookReader  # configured with `secrets`
    # Every secret the reader was configured with: the old and the new while rotating.
    secrets: tuple[str, ...]
    # The headers that sign `body` with `secret` at a unix time, as the provider does.
    sign: Callable[[bytes, str, int], Mapping[str, str]]
    # The unsigned body of the provider's event about one object.
    event: Callable[[EventAbout], bytes]
    # What its events can be about (a subset of payment, refund, card).
    object_kinds: frozenset[str]
    # How old a signature may be before the reader refuses it.
    tolerance: timedelta


def _fail(message: str) -> ConformanceError:
    return ConformanceError(message)


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


def _fixed_clock() -> Callable[[], datetime]:
    now = datetime.now(UTC).replace(microsecond=0)
    return lambda: now


def _about(object_kind: str, reference: str, *, final: bool = True, created: int) -> EventAbout:
    return EventAbout(
        event_id=f"evt_kit_{secrets.token_hex(8)}",
        object_kind=object_kind,
        reference=reference,
        final=final,
        created=created,
    )


def _read(
    webhooks: Webhooks,
    body: bytes,
    now: datetime,
    *,
    secret: str | None = None,
    signed_at: datetime | None = None,
) -> WebhookEvent:
    """The adapter's reading of `body` signed as its provider signs (by default
    with the newest secret, now)."""
    at = int((signed_at or now).timestamp())
    signed = webhooks.sign(body, secret or webhooks.secrets[-1], at)
    # As the web framework hands headers over: names in lower case.
    headers = {name.lower(): value for name, value in signed.items()}
    return webhooks.reader.read(body, headers, now)


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


# -- (a) the kind check --------------------------------------------------------------------------


async def check_kind(engine: AsyncEngine, webhooks: Webhooks) -> None:
    """An event about one kind of object never settles an operation of another
    kind: a payment's success names no refund or card of ours, and a refund's no
    payment. For each kind of object the adapter's events can be about and each
    kind of operation the kit makes (a payment, a refund, a card issue, all
    UNKNOWN), a signed, valid success event naming the operation by our
    reference is delivered. Where the kinds match it must settle the operation
    (so the check cannot pass by settling nothing); otherwise it must be
    stored as `wrong_kind`, recorded on no operation, and change nothing."""
    clock = _fixed_clock()
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


# -- (b) the mapping property --------------------------------------------------------------------

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
    "Succeeded",
    "SUCCEEDED",
    "Failed",
    "FAILED",
    "Canceled",
    "Cancelled",
    "Declined",
    "succeeded ",
    " failed",
    "",
    "None",
    "null",
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


# -- (c) webhook verification --------------------------------------------------------------------


async def check_webhook_verification(engine: AsyncEngine, webhooks: Webhooks) -> None:
    """The reader refuses a forged signature (another secret, a changed body,
    none at all) and a stale one (signed longer ago than its tolerance, or as
    far ahead); accepts every configured secret (the old and the new while
    rotating); and the ledger takes a duplicate delivery once and an older
    event delivered after a newer one as a record that changes nothing."""
    clock = _fixed_clock()
    now = clock()
    made = _Operations(engine, webhooks.provider, clock)
    object_kind = "payment" if "payment" in webhooks.object_kinds else min(webhooks.object_kinds)
    operation_kind = next(k for k, spoken in PLANTED.items() if spoken == object_kind)
    operation_id = await made.unknown(operation_kind)
    created = int(now.timestamp())
    body = webhooks.event(_about(object_kind, operation_id, created=created))

    refusals: dict[str, Callable[[], object]] = {
        "signed with another secret": lambda: _read(
            webhooks, body, now, secret="whsec_" + secrets.token_hex(16)
        ),
        "a changed body": lambda: webhooks.reader.read(
            body.replace(b"}", b" }", 1), _headers(webhooks, body, now), now
        ),
        "no signature": lambda: webhooks.reader.read(body, {}, now),
        "signed too long ago": lambda: _read(
            webhooks, body, now, signed_at=now - webhooks.tolerance - timedelta(seconds=1)
        ),
        "signed too far ahead": lambda: _read(
            webhooks, body, now, signed_at=now + webhooks.tolerance + timedelta(seconds=1)
        ),
    }
    problems = []
    for what, read in refusals.items():
        try:
            read()
        except SignatureRefused:
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
    older = webhooks.event(_about(object_kind, operation_id, final=False, created=created - 60))
    _, late = await _deliver(engine, clock, webhooks, older)
    operation = await made.get(operation_id)
    seen = await made.event_observations(operation_id)
    if first.disposition != "applied" or first.duplicate:
        problems.append(f"the first delivery was {first.disposition} (duplicate {first.duplicate})")
    if not again.duplicate or again.event_id != first_event.event_id:
        problems.append("a second delivery of the same event was not taken as a duplicate")
    if late.duplicate or late.disposition != "recorded":
        problems.append(f"an older event delivered late was {late.disposition}, not recorded")
    if (operation.state, operation.outcome) != (State.OUTCOME_KNOWN, Outcome.SUCCEEDED):
        problems.append(f"the operation ended {operation.state} {operation.outcome}")
    if operation.outcome_contradicted or operation.duplicate_detected:
        problems.append("a duplicate or late event raised a flag")
    if seen != 2:
        problems.append(f"{seen} observations, not one per distinct event (2)")
    if problems:
        raise _fail("; ".join(problems))


def _headers(webhooks: Webhooks, body: bytes, now: datetime) -> dict[str, str]:
    signed = webhooks.sign(body, webhooks.secrets[-1], int(now.timestamp()))
    return {name.lower(): value for name, value in signed.items()}
