"""The sandbox provider's HTTP face: Stripe-like charges whose faults are chosen, like test card
numbers, by `payment_method`; and beneficiaries, cards and card freezes whose faults are chosen
by `sandbox_scenario`.

It is a real server reached over loopback so the orchestrator meets real timeouts and real
dropped connections. Routes are relative; the caller mounts the app (at `/_sandbox`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Generic, Protocol, TypeVar

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from intentledger.providers.sandbox.resources import (
    BeneficiaryRequest,
    CardActionName,
    CardActionRequest,
    CardRequest,
    RefundRequest,
)
from intentledger.providers.sandbox.rows import JSONObject
from intentledger.providers.sandbox.store import (
    ChargeRequest,
    Effect,
    Execute,
    KeyedRequest,
    KeyReused,
    LeaveUnexecuted,
    Processed,
    ReceivedRequest,
    Replayed,
    Resource,
    SandboxStore,
    StoredResponse,
    StoreRefusal,
    TargetMissing,
    WriteOutcome,
)
from intentledger.providers.sandbox.webhooks import WEBHOOK_METHOD, SandboxWebhooks

logger = logging.getLogger(__name__)

W = TypeVar("W", bound=KeyedRequest)
B = TypeVar("B", bound=BaseModel)

# How often a withheld request checks whether its client has hung up.
DISCONNECT_POLL_SECONDS = 0.05
SHORT_HOLD_SECONDS = 1.0
MAX_IDEMPOTENCY_KEY_LENGTH = 255
# Status recorded nowhere and sent to no one: the client had already hung up (nginx's 499).
CLIENT_CLOSED_REQUEST = 499


def utc_now() -> datetime:
    return datetime.now(UTC)


# -- scenarios --------------------------------------------------------------------------------


class Delivery(Enum):
    """How the answer reaches the client, independent of what happened to the money."""

    ANSWER = "answer"
    WITHHOLD_THEN_ANSWER = "withhold_then_answer"
    WITHHOLD_THEN_TIMEOUT = "withhold_then_timeout"
    UNAVAILABLE = "unavailable"
    RATE_LIMITED = "rate_limited"
    SLOW = "slow"


@dataclass(frozen=True)
class Scenario:
    effect: Effect
    delivery: Delivery


def _error(status: int, error_type: str, code: str, message: str) -> StoredResponse:
    return StoredResponse(status, {"error": {"type": error_type, "code": code, "message": message}})


DECLINED = _error(402, "card_error", "card_declined", "Your card was declined.")
NO_SUCH_PAYMENT_METHOD = _error(
    400, "invalid_request_error", "resource_missing", "No such payment_method"
)
GATEWAY_TIMEOUT = _error(504, "api_error", "timeout", "The request timed out.")
UNAVAILABLE = _error(503, "api_error", "service_unavailable", "Try again later.")
RATE_LIMITED = _error(429, "rate_limit_error", "rate_limit", "Too many requests.")
KEY_REUSED = _error(
    400,
    "idempotency_error",
    "idempotency_key_reused",
    "This Idempotency-Key was already used with a different request body.",
)
REJECTED = _error(
    422,
    "invalid_request_error",
    "rejected",
    "The request was rejected (sandbox_scenario=declined).",
)
REFERENCE_MISSING = _error(
    400, "invalid_request_error", "parameter_missing", "The reference parameter is required."
)


def _no_such(resource: str, resource_id: str) -> StoredResponse:
    return _error(
        404, "invalid_request_error", "resource_missing", f"No such {resource}: {resource_id!r}"
    )


_OK = Scenario(Execute(), Delivery.ANSWER)

_EVERY_ATTEMPT: dict[str, Scenario] = {
    "pm_ok": _OK,
    "pm_declined": Scenario(StoreRefusal(DECLINED), Delivery.ANSWER),
    "pm_blackhole": Scenario(LeaveUnexecuted(), Delivery.WITHHOLD_THEN_TIMEOUT),
    "pm_slow": Scenario(Execute(), Delivery.SLOW),
    # Executes, never answers, and tells by webhook (providers/sandbox/webhooks.py).
    WEBHOOK_METHOD: Scenario(Execute(), Delivery.WITHHOLD_THEN_TIMEOUT),
}

# Faults that strike only the first submit for a reference; retries then behave like pm_ok.
_FIRST_ATTEMPT_ONLY: dict[str, Scenario] = {
    "pm_timeout_after_execute": Scenario(Execute(), Delivery.WITHHOLD_THEN_ANSWER),
    "pm_timeout_before_execute": Scenario(LeaveUnexecuted(), Delivery.WITHHOLD_THEN_TIMEOUT),
    "pm_unavailable": Scenario(LeaveUnexecuted(), Delivery.UNAVAILABLE),
    "pm_rate_limited": Scenario(LeaveUnexecuted(), Delivery.RATE_LIMITED),
    "pm_lookup_lag": Scenario(Execute(), Delivery.WITHHOLD_THEN_ANSWER),
}

# An unknown payment method is a final answer, kept against the key like a decline.
_UNKNOWN_METHOD = Scenario(StoreRefusal(NO_SUCH_PAYMENT_METHOD), Delivery.ANSWER)

LOOKUP_LAG_METHOD = "pm_lookup_lag"
# How long a pm_lookup_lag charge stays hidden from lookups, unless told otherwise.
DEFAULT_LOOKUP_LAG_SECONDS = 3.0
BLACKHOLE_METHOD = "pm_blackhole"


def scenario_for(payment_method: str, first_attempt: bool) -> Scenario:
    if payment_method in _FIRST_ATTEMPT_ONLY:
        return _FIRST_ATTEMPT_ONLY[payment_method] if first_attempt else _OK
    return _EVERY_ATTEMPT.get(payment_method, _UNKNOWN_METHOD)


# Beneficiaries, cards and card actions take their fault from `sandbox_scenario` instead, so
# no fake payment method has to ride along on a request that has none.
DEFAULT_WRITE_SCENARIO = "ok"

_WRITE_EVERY_ATTEMPT: dict[str, Scenario] = {
    "ok": _OK,
    "declined": Scenario(StoreRefusal(REJECTED), Delivery.ANSWER),
}

# First attempt per (resource, reference); retries then behave like "ok".
_WRITE_FIRST_ATTEMPT_ONLY: dict[str, Scenario] = {
    "timeout_after_execute": Scenario(Execute(), Delivery.WITHHOLD_THEN_ANSWER),
    "timeout_before_execute": Scenario(LeaveUnexecuted(), Delivery.WITHHOLD_THEN_TIMEOUT),
}

WRITE_SCENARIOS = (*_WRITE_EVERY_ATTEMPT, *_WRITE_FIRST_ATTEMPT_ONLY)


def write_scenario_for(name: str, first_attempt: bool) -> Scenario:
    """The fault for a validated `sandbox_scenario` (unknown names never reach here)."""
    if name in _WRITE_FIRST_ATTEMPT_ONLY:
        return _WRITE_FIRST_ATTEMPT_ONLY[name] if first_attempt else _OK
    return _WRITE_EVERY_ATTEMPT[name]


# -- request parsing --------------------------------------------------------------------------


class ChargeBody(BaseModel):
    # Strict: "1000" or 10.0 is not an amount; a payments API should refuse, not coerce.
    model_config = ConfigDict(strict=True)

    reference: str = Field(min_length=1)
    # SQLite integers are 64-bit; a larger amount must be refused, not crash the insert.
    amount: int = Field(gt=0, lt=2**63)
    currency: str = Field(min_length=1)
    payment_method: str = Field(min_length=1)
    description: str | None = None
    metadata: dict[str, str] | None = None


# Country code, check digits, then the basic bank account number. No mod-97 check: the
# sandbox accepts made-up test IBANs as long as they are shaped like one.
IBAN_PATTERN = r"^[A-Za-z]{2}[0-9]{2}[A-Za-z0-9]{11,30}$"


class WriteBody(BaseModel):
    """What every beneficiary, card and card-action write carries."""

    model_config = ConfigDict(strict=True)

    reference: str = Field(min_length=1)
    sandbox_scenario: str | None = None

    @field_validator("sandbox_scenario")
    @classmethod
    def _known_scenario(cls, value: str | None) -> str | None:
        # Refused as an invalid parameter (nothing executed, nothing kept), unlike an unknown
        # payment method, which names a missing resource and is a kept answer.
        if value is not None and value not in WRITE_SCENARIOS:
            raise ValueError(
                f"unknown sandbox_scenario; expected one of {', '.join(WRITE_SCENARIOS)}"
            )
        return value

    @property
    def scenario(self) -> str:
        if self.sandbox_scenario is None:
            return DEFAULT_WRITE_SCENARIO
        return self.sandbox_scenario


class BeneficiaryBody(WriteBody):
    name: str = Field(min_length=1, max_length=140)
    iban: str = Field(pattern=IBAN_PATTERN)


class CardBody(WriteBody):
    label: str | None = Field(default=None, max_length=100)


class CardActionBody(WriteBody):
    pass


class RefundBody(WriteBody):
    charge: str = Field(min_length=1)
    # SQLite integers are 64-bit; a larger amount must be refused, not crash the insert.
    amount: int = Field(gt=0, lt=2**63)
    reason: str | None = Field(default=None, max_length=500)


@dataclass(frozen=True)
class ParsedWrite(Generic[W]):
    request: W
    scenario: str


# Turns (idempotency key, JSON object body) into a write for the store, or a 400 to answer.
Parse = Callable[[str, JSONObject], ParsedWrite[W] | StoredResponse]
# A store method that runs one kind of write in its transaction.
Perform = Callable[[int, W, datetime, Callable[[bool], Effect]], WriteOutcome]


def _parse_json_object(raw: bytes) -> JSONObject | None:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _optional_str(payload: JSONObject | None, name: str) -> str | None:
    value = None if payload is None else payload.get(name)
    return value if isinstance(value, str) else None


def fingerprint(payload: JSONObject) -> str:
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def route_fingerprint(route: str, payload: JSONObject) -> str:
    """The body and the route it was sent to, so one key reused on another endpoint (or on
    another card) is a different request.

    Charges keep the body-only `fingerprint`: keys already kept in an existing sandbox file
    must still replay. That form cannot equal this one (it would take a SHA-256 collision),
    so reuse across charges and the other endpoints is caught in both directions.
    """
    return fingerprint({"route": route, "body": payload})


def _invalid(code: str, message: str) -> StoredResponse:
    return _error(400, "invalid_request_error", code, message)


def _key_problem(key: str | None) -> StoredResponse | None:
    if not key:
        return _invalid("parameter_missing", "The Idempotency-Key header is required.")
    if len(key) > MAX_IDEMPOTENCY_KEY_LENGTH:
        return _invalid("parameter_invalid", "Idempotency-Key is longer than 255 characters.")
    return None


def _charge_request(key: str, payload: JSONObject | None) -> ChargeRequest | StoredResponse:
    if payload is None:
        return _invalid("parameter_invalid", "The body must be a JSON object.")
    try:
        body = ChargeBody.model_validate(payload)
    except ValidationError as exc:
        return _invalid("parameter_invalid", _describe(exc))
    return ChargeRequest(
        reference=body.reference,
        idempotency_key=key,
        amount=body.amount,
        currency=body.currency,
        payment_method=body.payment_method,
        fingerprint=fingerprint(payload),
    )


def _validated(model: type[B], payload: JSONObject) -> B | StoredResponse:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        return _invalid("parameter_invalid", _describe(exc))


def parse_beneficiary(
    key: str, payload: JSONObject
) -> ParsedWrite[BeneficiaryRequest] | StoredResponse:
    body = _validated(BeneficiaryBody, payload)
    if isinstance(body, StoredResponse):
        return body
    request = BeneficiaryRequest(
        reference=body.reference,
        idempotency_key=key,
        name=body.name,
        iban=body.iban,
        fingerprint=route_fingerprint("POST /v1/beneficiaries", payload),
    )
    return ParsedWrite(request, body.scenario)


def parse_card(key: str, payload: JSONObject) -> ParsedWrite[CardRequest] | StoredResponse:
    body = _validated(CardBody, payload)
    if isinstance(body, StoredResponse):
        return body
    request = CardRequest(
        reference=body.reference,
        idempotency_key=key,
        label=body.label,
        fingerprint=route_fingerprint("POST /v1/cards", payload),
    )
    return ParsedWrite(request, body.scenario)


def card_action_parser(card_id: str, action: CardActionName) -> Parse[CardActionRequest]:
    route = f"POST /v1/cards/{card_id}/{action}"

    def parse(key: str, payload: JSONObject) -> ParsedWrite[CardActionRequest] | StoredResponse:
        body = _validated(CardActionBody, payload)
        if isinstance(body, StoredResponse):
            return body
        request = CardActionRequest(
            card_id=card_id,
            action=action,
            reference=body.reference,
            idempotency_key=key,
            fingerprint=route_fingerprint(route, payload),
        )
        return ParsedWrite(request, body.scenario)

    return parse


def parse_refund(key: str, payload: JSONObject) -> ParsedWrite[RefundRequest] | StoredResponse:
    body = _validated(RefundBody, payload)
    if isinstance(body, StoredResponse):
        return body
    request = RefundRequest(
        charge_id=body.charge,
        reference=body.reference,
        idempotency_key=key,
        amount=body.amount,
        reason=body.reason,
        fingerprint=route_fingerprint("POST /v1/refunds", payload),
    )
    return ParsedWrite(request, body.scenario)


def _describe(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
        for error in exc.errors()
    )


# -- responses --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    body: JSONObject
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, stored: StoredResponse, headers: dict[str, str] | None = None) -> Reply:
        return cls(stored.status, stored.body, headers or {})

    def to_response(self) -> Response:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


class ProviderView(Protocol):
    """A resource as the provider's API shows it."""

    def as_provider_response(self) -> JSONObject: ...


@dataclass(frozen=True)
class Withhold:
    """An answer given only after `seconds`, and only if the client is still there."""

    seconds: float
    stored: StoredResponse


# What a handler decided, inside the store's thread, to send back.
Plan = Reply | Withhold


def _replayed(stored: StoredResponse) -> Reply:
    return Reply.of(stored, {"Idempotent-Replayed": "true"})


def _required(stored: StoredResponse | None) -> StoredResponse:
    # Only effects that keep a response are paired with deliveries that answer with it.
    if stored is None:
        raise RuntimeError("scenario answers with a stored response but none was kept")
    return stored


# -- the sandbox ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    withhold_seconds: float
    lookup_lag_seconds: float
    slow_seconds: float


class Sandbox:
    """Route handlers over one store; everything mutable lives in the store's file."""

    def __init__(
        self,
        store: SandboxStore,
        timing: Timing,
        clock: Callable[[], datetime],
        webhooks: SandboxWebhooks | None = None,
    ):
        self._store = store
        self._timing = timing
        self._clock = clock
        self._webhooks = webhooks

    async def create_charge(self, request: Request) -> Response:
        payload = _parse_json_object(await request.body())
        key = request.headers.get("Idempotency-Key")
        received = ReceivedRequest(
            "charge",
            "submit",
            _optional_str(payload, "reference"),
            key,
            self._clock(),
            payment_method=_optional_str(payload, "payment_method"),
        )
        if self._webhooks is not None and received.payment_method == WEBHOOK_METHOD:
            reference = received.reference
            if reference:
                self._webhooks.after_charge(reference, self._store.charges)
        return await self._handle(
            request, received, lambda request_id: self._answer_submit(key, payload, request_id)
        )

    async def lookup_charges(self, request: Request) -> Response:
        reference = request.query_params.get("reference")
        received = ReceivedRequest("charge", "lookup", reference, None, self._clock())
        return await self._handle(request, received, lambda _: self._answer_lookup(reference))

    # -- beneficiaries and cards ------------------------------------------------------------

    async def create_beneficiary(self, request: Request) -> Response:
        return await self._write(
            request, "beneficiary", parse_beneficiary, self._store.create_beneficiary
        )

    async def issue_card(self, request: Request) -> Response:
        return await self._write(request, "card", parse_card, self._store.issue_card)

    async def freeze_card(self, request: Request) -> Response:
        return await self._act_on_card(request, request.path_params["card_id"], "freeze")

    async def unfreeze_card(self, request: Request) -> Response:
        return await self._act_on_card(request, request.path_params["card_id"], "unfreeze")

    async def create_refund(self, request: Request) -> Response:
        return await self._write(request, "refund", parse_refund, self._store.create_refund)

    async def lookup_refunds(self, request: Request) -> Response:
        return await self._lookup_by_reference(request, "refund", self._store.refunds)

    async def lookup_beneficiaries(self, request: Request) -> Response:
        return await self._lookup_by_reference(request, "beneficiary", self._store.beneficiaries)

    async def lookup_cards(self, request: Request) -> Response:
        return await self._lookup_by_reference(request, "card", self._store.cards)

    async def _lookup_by_reference(
        self,
        request: Request,
        resource: Resource,
        find: Callable[[str], Sequence[ProviderView]],
    ) -> Response:
        reference = request.query_params.get("reference")

        def answer(_: int) -> Plan:
            if not reference:
                return Reply.of(REFERENCE_MISSING)
            return Reply(200, {"data": [item.as_provider_response() for item in find(reference)]})

        received = ReceivedRequest(resource, "lookup", reference, None, self._clock())
        return await self._handle(request, received, answer)

    async def retrieve_card(self, request: Request) -> Response:
        card_id: str = request.path_params["card_id"]

        def answer(_: int) -> Plan:
            card = self._store.card(card_id)
            if card is None:
                return Reply.of(_no_such("card", card_id))
            return Reply(200, card.as_provider_response())

        received = ReceivedRequest("card", "lookup", None, None, self._clock(), card_id=card_id)
        return await self._handle(request, received, answer)

    # -- the truth, for tests: no faults, no lag, not logged --------------------------------

    async def truth(self, request: Request) -> Response:
        charges = self._store.charges(_param(request, "reference"))
        return _listing(charge.as_truth_entry() for charge in charges)

    async def beneficiaries_truth(self, request: Request) -> Response:
        found = self._store.beneficiaries(_param(request, "reference"))
        return _listing(beneficiary.as_truth_entry() for beneficiary in found)

    async def cards_truth(self, request: Request) -> Response:
        cards = self._store.cards(_param(request, "reference"))
        return _listing(card.as_truth_entry() for card in cards)

    async def card_actions_truth(self, request: Request) -> Response:
        actions = self._store.card_actions(_param(request, "reference"), _param(request, "card_id"))
        return _listing(action.as_truth_entry() for action in actions)

    async def refunds_truth(self, request: Request) -> Response:
        found = self._store.refunds(_param(request, "reference"), _param(request, "charge"))
        return _listing(refund.as_truth_entry() for refund in found)

    async def received(self, request: Request) -> Response:
        records = self._store.requests(_param(request, "reference"), _param(request, "resource"))
        return _listing(record.as_entry() for record in records)

    async def healthz(self, request: Request) -> Response:
        self._store.ping()
        return JSONResponse({"status": "ok"})

    # -- submit ---------------------------------------------------------------------------

    def _answer_submit(self, key: str | None, payload: JSONObject | None, request_id: int) -> Plan:
        problem = _key_problem(key)
        if problem is not None:
            return Reply.of(problem)
        assert key is not None  # _key_problem rejected a missing key
        charge_request = _charge_request(key, payload)
        if isinstance(charge_request, StoredResponse):
            return Reply.of(charge_request)
        method = charge_request.payment_method
        outcome = self._store.submit(
            request_id,
            charge_request,
            self._clock(),
            lambda first_attempt: scenario_for(method, first_attempt).effect,
        )
        return self._reply_to(outcome, lambda first_attempt: scenario_for(method, first_attempt))

    # -- other writes ---------------------------------------------------------------------

    async def _act_on_card(
        self, request: Request, card_id: str, action: CardActionName
    ) -> Response:
        parse = card_action_parser(card_id, action)
        return await self._write(
            request, "card_action", parse, self._store.act_on_card, card_id=card_id
        )

    async def _write(
        self,
        request: Request,
        resource: Resource,
        parse: Parse[W],
        perform: Perform[W],
        card_id: str | None = None,
    ) -> Response:
        payload = _parse_json_object(await request.body())
        key = request.headers.get("Idempotency-Key")
        received = ReceivedRequest(
            resource,
            "submit",
            _optional_str(payload, "reference"),
            key,
            self._clock(),
            sandbox_scenario=_optional_str(payload, "sandbox_scenario"),
            card_id=card_id,
        )

        def answer(request_id: int) -> Plan:
            return self._answer_write(key, payload, request_id, parse, perform)

        return await self._handle(request, received, answer)

    def _answer_write(
        self,
        key: str | None,
        payload: JSONObject | None,
        request_id: int,
        parse: Parse[W],
        perform: Perform[W],
    ) -> Plan:
        problem = _key_problem(key)
        if problem is not None:
            return Reply.of(problem)
        assert key is not None  # _key_problem rejected a missing key
        if payload is None:
            return Reply.of(_invalid("parameter_invalid", "The body must be a JSON object."))
        parsed = parse(key, payload)
        if isinstance(parsed, StoredResponse):
            return Reply.of(parsed)
        name = parsed.scenario
        outcome = perform(
            request_id,
            parsed.request,
            self._clock(),
            lambda first_attempt: write_scenario_for(name, first_attempt).effect,
        )
        return self._reply_to(
            outcome, lambda first_attempt: write_scenario_for(name, first_attempt)
        )

    def _reply_to(
        self, outcome: WriteOutcome, scenario_for_attempt: Callable[[bool], Scenario]
    ) -> Plan:
        match outcome:
            case Replayed(response=stored):
                return _replayed(stored)
            case KeyReused():
                return Reply.of(KEY_REUSED)
            case TargetMissing(resource=resource, id=missing_id):
                return Reply.of(_no_such(resource, missing_id))
            case Processed(first_attempt=first_attempt, response=stored):
                delivery = scenario_for_attempt(first_attempt).delivery
                return self._deliver(delivery, stored)

    def _deliver(self, delivery: Delivery, stored: StoredResponse | None) -> Plan:
        """The reply, or the reply to give only if the client waits long enough for it."""
        withhold = self._timing.withhold_seconds
        match delivery:
            case Delivery.ANSWER:
                return Reply.of(_required(stored))
            case Delivery.UNAVAILABLE:
                return Reply.of(UNAVAILABLE, {"Retry-After": "2"})
            case Delivery.RATE_LIMITED:
                return Reply.of(RATE_LIMITED, {"Retry-After": "1"})
            case Delivery.WITHHOLD_THEN_TIMEOUT:
                return Withhold(withhold, GATEWAY_TIMEOUT)
            case Delivery.WITHHOLD_THEN_ANSWER:
                return Withhold(withhold, _required(stored))
            case Delivery.SLOW:
                return Withhold(self._timing.slow_seconds, _required(stored))

    # -- lookup ---------------------------------------------------------------------------

    def _answer_lookup(self, reference: str | None) -> Plan:
        if not reference:
            return Reply.of(REFERENCE_MISSING)
        if self._store.was_submitted_with(reference, BLACKHOLE_METHOD):
            return Withhold(self._timing.withhold_seconds, GATEWAY_TIMEOUT)
        charges = self._store.charges(reference)
        now = self._clock()
        lag = timedelta(seconds=self._timing.lookup_lag_seconds)
        # A lagging provider has executed the charge but its read side does not know yet.
        visible = [
            charge
            for charge in charges
            if charge.payment_method != LOOKUP_LAG_METHOD or now - charge.executed_at >= lag
        ]
        return Reply(200, {"data": [charge.as_lookup_entry() for charge in visible]})

    # -- plumbing -------------------------------------------------------------------------

    async def _handle(
        self, request: Request, received: ReceivedRequest, answer: Callable[[int], Plan]
    ) -> Response:
        """Log the request, work out its answer and, when that goes out at once, record its
        status. The store's work runs on the event loop (see `SandboxStore`)."""
        request_id, plan = self._log_and_answer(received, answer)
        if isinstance(plan, Reply):
            return plan.to_response()
        if await _hold(request, plan.seconds):
            reply = Reply.of(plan.stored)
            self._record_status(request_id, reply.status)
            return reply.to_response()
        # Nobody is listening; the status stays NULL to say no answer was delivered.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    def _log_and_answer(
        self, received: ReceivedRequest, answer: Callable[[int], Plan]
    ) -> tuple[int, Plan]:
        # Logged (and committed) before anything else, so tests can count every request,
        # even ones that hang or fail.
        request_id = self._store.log_request(received)
        plan = answer(request_id)
        if isinstance(plan, Reply):
            self._record_status(request_id, plan.status)
        return request_id, plan

    def _record_status(self, request_id: int, status: int) -> None:
        try:
            self._store.record_response_status(request_id, status)
        except sqlite3.Error:
            # Best effort: the request log is for observers; the answer matters more.
            logger.warning("could not record response status for request %s", request_id)


def _param(request: Request, name: str) -> str | None:
    return request.query_params.get(name)


def _listing(entries: Iterable[JSONObject]) -> Response:
    return JSONResponse({"data": list(entries)})


async def _hold(request: Request, seconds: float) -> bool:
    """Withhold the answer for `seconds` or until the client hangs up; True if still there.

    A hold of up to `SHORT_HOLD_SECONDS` (a slow provider's answer) looks for the
    hang-up once, at its end: looking every 50 ms was most of the CPU a slow
    sandbox spent on a 200 ms charge, on cores it shares with the code under test.
    """
    if seconds <= SHORT_HOLD_SECONDS:
        await anyio.sleep(seconds)
        return not await request.is_disconnected()
    deadline = anyio.current_time() + seconds
    while (remaining := deadline - anyio.current_time()) > 0:
        if await request.is_disconnected():
            return False
        await anyio.sleep(min(DISCONNECT_POLL_SECONDS, remaining))
    return not await request.is_disconnected()


def create_sandbox_app(
    database_path: str,
    key_retention: timedelta,
    withhold_seconds: float = 60.0,
    lookup_lag_seconds: float = DEFAULT_LOOKUP_LAG_SECONDS,
    *,
    slow_seconds: float = 1.0,
    clock: Callable[[], datetime] = utc_now,
    webhooks: SandboxWebhooks | None = None,
) -> Starlette:
    """The sandbox provider as an ASGI app with relative routes; mount it where you like."""
    sandbox = Sandbox(
        SandboxStore(database_path, key_retention),
        Timing(withhold_seconds, lookup_lag_seconds, slow_seconds),
        clock,
        webhooks,
    )
    # Plain Starlette: FastAPI's dependency solving and extra middleware cost the sandbox
    # (which shares the machine with the code under test) more CPU than its routes did.
    return Starlette(
        routes=[
            Route("/v1/charges", sandbox.create_charge, methods=["POST"]),
            Route("/v1/charges", sandbox.lookup_charges, methods=["GET"]),
            Route("/v1/beneficiaries", sandbox.create_beneficiary, methods=["POST"]),
            Route("/v1/beneficiaries", sandbox.lookup_beneficiaries, methods=["GET"]),
            Route("/v1/cards", sandbox.issue_card, methods=["POST"]),
            Route("/v1/cards", sandbox.lookup_cards, methods=["GET"]),
            Route("/v1/cards/{card_id}", sandbox.retrieve_card, methods=["GET"]),
            Route("/v1/cards/{card_id}/freeze", sandbox.freeze_card, methods=["POST"]),
            Route("/v1/cards/{card_id}/unfreeze", sandbox.unfreeze_card, methods=["POST"]),
            Route("/v1/refunds", sandbox.create_refund, methods=["POST"]),
            Route("/v1/refunds", sandbox.lookup_refunds, methods=["GET"]),
            Route("/charges", sandbox.truth, methods=["GET"]),
            Route("/refunds", sandbox.refunds_truth, methods=["GET"]),
            Route("/beneficiaries", sandbox.beneficiaries_truth, methods=["GET"]),
            Route("/cards", sandbox.cards_truth, methods=["GET"]),
            Route("/card_actions", sandbox.card_actions_truth, methods=["GET"]),
            Route("/requests", sandbox.received, methods=["GET"]),
            Route("/healthz", sandbox.healthz, methods=["GET"]),
        ]
    )
