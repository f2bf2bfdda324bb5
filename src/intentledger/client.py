"""A Python client for intentledger's API, sync (`Client`) and async (`AsyncClient`).

The client does what a careful caller of a payments API must:

- every logical call gets one `Idempotency-Key` (made here unless given), and
  every retry of that call sends the same key, so a lost answer can never make
  a second payment;
- transport failures (no connection, an answer cut off, a timeout) and 5xx
  answers are retried with that key, a bounded number of times, with
  exponential backoff, waiting what a `Retry-After` asks (a longer ask than
  the cap ends the retries: the caller hears the answer); so are 408 and 409
  `request-in-progress` (the original is still being answered); every error
  carries the key, to retry with;
- answers come back as typed objects, problem documents as typed errors; an
  operation whose outcome is UNKNOWN is returned as what it is, never raised;
- `wait` returns when an operation's outcome is known or a person is needed;
- `verify_webhook` checks a merchant webhook's Standard Webhooks signature,
  and `is_newer` tells a stale or repeated one (by its object's `version`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote, urlencode

import httpx

from intentledger.domain.signatures import (
    STANDARD_TOLERANCE_SECONDS,
    SignatureRefused,
    verify_standard_signature,
)

T = TypeVar("T")
# Outcomes a caller waits for: known, or handed to a person.
SETTLED_STATES = frozenset({"OUTCOME_KNOWN", "CANCELLED"})
# How far a webhook's timestamp may be from now (the Standard Webhooks default).
WEBHOOK_TOLERANCE_SECONDS = STANDARD_TOLERANCE_SECONDS


@dataclass(frozen=True)
class Operation:
    """A payment, a refund or a synchronous write (a beneficiary, a card action),
    as `GET /v1/operations/{id}` shows it."""

    id: str
    state: str
    kind: str
    next_action: str
    outcome: str | None
    provider_reference: str | None
    amount: int | None
    currency: str | None
    duplicate_detected: bool
    outcome_contradicted: bool
    # Counts the changes of the operation's own record (state, outcome, flags):
    # a later look with a higher version is newer in those.
    version: int
    # Payments only: what has been refunded, and what still can be. Read from
    # the payment's refunds when it is looked at; a refund does not change the
    # payment's version (each refund is an operation with its own).
    amount_refunded: int | None
    amount_refundable: int | None
    # Refunds only: the payment refunded.
    payment_id: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    replayed: bool = False

    @property
    def settled(self) -> bool:
        return self.state in SETTLED_STATES

    @property
    def needs_a_person(self) -> bool:
        return self.next_action == "operator"

    @classmethod
    def of(cls, document: dict[str, Any], replayed: bool = False) -> Operation:
        return cls(
            id=document["id"],
            state=document["state"],
            kind=document.get("kind", "payment"),
            next_action=document.get("next_action", ""),
            outcome=document.get("outcome"),
            provider_reference=document.get("provider_reference"),
            amount=document.get("amount"),
            currency=document.get("currency"),
            duplicate_detected=bool(document.get("duplicate_detected")),
            outcome_contradicted=bool(document.get("outcome_contradicted")),
            version=_integer(document["version"]),
            amount_refunded=document.get("amount_refunded"),
            amount_refundable=document.get("amount_refundable"),
            payment_id=document.get("payment_id"),
            raw=document,
            replayed=replayed,
        )


@dataclass(frozen=True)
class Mandate:
    id: str
    status: str
    currency: str
    max_amount: int
    total_limit: int
    reserved: int
    spent: int
    version: int
    raw: dict[str, Any] = field(repr=False, compare=False)
    replayed: bool = False

    @classmethod
    def of(cls, document: dict[str, Any], replayed: bool = False) -> Mandate:
        return cls(
            id=document["id"],
            status=document["status"],
            currency=document["currency"],
            max_amount=document["max_amount"],
            total_limit=document["total_limit"],
            reserved=document.get("reserved", 0),
            spent=document.get("spent", 0),
            version=_integer(document["version"]),
            raw=document,
            replayed=replayed,
        )


@dataclass(frozen=True)
class WebhookEndpoint:
    id: str
    url: str
    events: list[str] | None
    # Only in the creation's answer (and its idempotent replay): keep it.
    secret: str | None = field(repr=False)
    raw: dict[str, Any] = field(repr=False, compare=False)
    replayed: bool = False
    # When it was deleted: a deleted endpoint still reads back, and is never sent to.
    deleted_at: str | None = None

    @classmethod
    def of(cls, document: dict[str, Any], replayed: bool = False) -> WebhookEndpoint:
        return cls(
            id=document["id"],
            url=document["url"],
            events=document["events"],
            deleted_at=document.get("deleted_at"),
            secret=document.get("secret"),
            raw=document,
            replayed=replayed,
        )


@dataclass(frozen=True)
class TimelineEvent:
    """One entry of an operation's timeline: a `transition`, an `observation`
    (what was seen) or a `decision` (what was decided, and why)."""

    type: str
    at: str
    source: str | None
    reason: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, document: dict[str, Any]) -> TimelineEvent:
        return cls(
            type=document["type"],
            at=document["at"],
            source=document.get("source"),
            reason=document.get("reason"),
            raw=document,
        )


@dataclass(frozen=True)
class DeliveryAttempt:
    at: str
    duration_ms: int
    http_status: int | None
    error: str | None
    delivered: bool
    next_attempt_at: str | None

    @classmethod
    def of(cls, document: dict[str, Any]) -> DeliveryAttempt:
        return cls(
            at=document["at"],
            duration_ms=document["duration_ms"],
            http_status=document.get("http_status"),
            error=document.get("error"),
            delivered=bool(document["delivered"]),
            next_attempt_at=document.get("next_attempt_at"),
        )


@dataclass(frozen=True)
class Delivery:
    """One event sent (or being sent) to one endpoint, with every attempt."""

    id: int
    event_id: str
    type: str
    object_id: str
    status: str  # pending | delivered | failed | cancelled
    in_flight: bool
    next_attempt_at: str | None
    attempts: list[DeliveryAttempt]
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, document: dict[str, Any]) -> Delivery:
        return cls(
            id=_integer(document["id"]),
            event_id=document["event_id"],
            type=document["type"],
            object_id=document["object_id"],
            status=document["status"],
            in_flight=bool(document.get("in_flight")),
            next_attempt_at=document.get("next_attempt_at"),
            attempts=[DeliveryAttempt.of(a) for a in document["attempts"]],
            raw=document,
        )


@dataclass(frozen=True)
class DeliveryPage:
    """Deliveries newest first; while `has_more`, pass `next_starting_after` as
    `starting_after` for the older ones."""

    deliveries: list[Delivery]
    has_more: bool

    @property
    def next_starting_after(self) -> int | None:
        return self.deliveries[-1].id if self.has_more and self.deliveries else None

    @classmethod
    def of(cls, document: dict[str, Any]) -> DeliveryPage:
        return cls([Delivery.of(d) for d in document["data"]], bool(document["has_more"]))


@dataclass(frozen=True)
class Card:
    id: str
    label: str | None
    status: str  # pending | active | frozen | not_issued
    # True while an operation on the card has no known outcome.
    indeterminate: bool
    pending_operation_id: str | None
    provider_card_id: str | None
    version: int
    # The write that answered with this card (an issue, a freeze...); None on a read.
    operation: Operation | None
    raw: dict[str, Any] = field(repr=False, compare=False)
    replayed: bool = False

    @classmethod
    def of(cls, document: dict[str, Any], replayed: bool = False) -> Card:
        written = document.get("operation")
        return cls(
            id=document["id"],
            label=document.get("label"),
            status=document["status"],
            indeterminate=bool(document["indeterminate"]),
            pending_operation_id=document.get("pending_operation_id"),
            provider_card_id=document.get("provider_card_id"),
            version=_integer(document["version"]),
            operation=None if written is None else Operation.of(written, replayed),
            raw=document,
            replayed=replayed,
        )


def _integer(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{value!r} is not an integer")
    return value


# -- errors -----------------------------------------------------------------------------------


class IntentledgerError(Exception):
    """A problem document (RFC 9457) the API answered with."""

    def __init__(
        self, status: int, problem: dict[str, Any], idempotency_key: str | None = None
    ) -> None:
        self.status = status
        self.problem = problem
        # The key the call was sent with: retry with it, never with a new one.
        self.idempotency_key = idempotency_key
        self.type = str(problem.get("type", ""))
        self.detail = str(problem.get("detail", ""))
        super().__init__(f"{status} {problem.get('title', '')}: {self.detail}".strip())


class Unauthorized(IntentledgerError):
    """401 or 403: the token is missing, unknown, revoked, or lacks the role."""


class NotFound(IntentledgerError):
    """404."""


class Conflict(IntentledgerError):
    """409: the key was used with another request, or longer ago than the replay
    window (`key-expired`: a new request needs a new key), or the state does not
    allow it."""


class ValidationFailed(IntentledgerError):
    """400, 413, 415 or 422: the request itself was refused; nothing was stored."""


class Unavailable(IntentledgerError):
    """5xx still answered after every retry (the request may be retried, same key)."""


class BadAnswer(IntentledgerError):
    """A 2xx (or other non-error status) whose body is not the document the API
    promises. The call may well have been stored: retry with the same key."""


class GaveUp(Exception):
    """No answer after every retry. The call may or may not have been stored:
    call again with the same `idempotency_key` to find out, never with a new one."""

    def __init__(self, idempotency_key: str, cause: BaseException) -> None:
        super().__init__(f"no answer after retries (Idempotency-Key {idempotency_key}): {cause}")
        self.idempotency_key = idempotency_key


def _error_for(status: int, problem: dict[str, Any], key: str | None) -> IntentledgerError:
    if status in (401, 403):
        return Unauthorized(status, problem, key)
    if status == 404:
        return NotFound(status, problem, key)
    if status == 409:
        return Conflict(status, problem, key)
    if status >= 500:
        return Unavailable(status, problem, key)
    return ValidationFailed(status, problem, key)


# -- the retry policy (shared by both clients) ---------------------------------------------------


@dataclass(frozen=True)
class Retries:
    attempts: int = 6
    backoff: float = 0.2  # seconds before the second attempt, doubled each time
    cap: float = 5.0  # no wait longer than this, whatever Retry-After says

    def delay(self, attempt: int, response: httpx.Response | None) -> float | None:
        """How long to wait before the next attempt; None when the server asks
        for longer than the cap (the caller hears the answer, and its key)."""
        wait = min(self.cap, self.backoff * 2.0 ** (attempt - 1))
        asked = str(response.headers.get("retry-after", "")) if response is not None else ""
        if asked.isascii() and asked.isdigit() and len(asked) <= 9:
            if float(asked) > self.cap:
                return None
            wait = max(wait, float(asked))
        return wait


def _retryable(response: httpx.Response) -> bool:
    # Every 5xx, and the edge's 408 (the body did not arrive in time): the
    # same key makes a retry safe.
    if response.status_code >= 500 or response.status_code == 408:
        return True
    # The original request under this key is still being answered.
    kind = str(_problem(response).get("type", ""))
    return response.status_code == 409 and kind.endswith("request-in-progress")


def _problem(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {"title": response.reason_phrase, "detail": response.text[:500]}
    return body if isinstance(body, dict) else {"detail": str(body)[:500]}


def _document(response: httpx.Response, key: str | None, has_id: bool = True) -> dict[str, Any]:
    if response.status_code >= 400:
        raise _error_for(response.status_code, _problem(response), key)
    try:
        body = response.json()
    except ValueError:
        body = None
    if (
        not 200 <= response.status_code < 300
        or not isinstance(body, dict)
        or (has_id and "id" not in body)
    ):
        raise BadAnswer(response.status_code, {"detail": response.text[:500]}, key)
    return body


def _read(kind: Callable[[dict[str, Any]], T], body: dict[str, Any], key: str | None) -> T:
    try:
        return kind(body)
    except (KeyError, TypeError) as exc:
        raise BadAnswer(200, {"detail": f"missing or malformed field: {exc}"}, key) from exc


def _replayed(response: httpx.Response) -> bool:
    return bool(response.headers.get("idempotent-replayed") == "true")


def new_key() -> str:
    return "il-" + secrets.token_urlsafe(18)


# -- the calls: what each method sends and how its answer reads (shared by both clients) ---------


@dataclass(frozen=True)
class _Call(Generic[T]):
    method: str
    path: str
    read: Callable[[dict[str, Any], bool], T]  # the document, and whether it was replayed
    body: Any = None
    # A write's Idempotency-Key: sent on the first attempt and on every retry.
    key: str | None = None
    # A list's answer is {"data": [...]}, with no id of its own.
    has_id: bool = True

    def answer(self, response: httpx.Response) -> T:
        document = _document(response, self.key, self.has_id)
        return _read(lambda d: self.read(d, _replayed(response)), document, self.key)


def _keyed(
    path: str, read: Callable[[dict[str, Any], bool], T], body: Any, key: str | None
) -> _Call[T]:
    return _Call("POST", path, read, body, key or new_key())


def _get(path: str, read: Callable[[dict[str, Any]], T]) -> _Call[T]:
    return _Call("GET", path, lambda document, _replayed: read(document))


def _get_list(path: str, read: Callable[[dict[str, Any]], T]) -> _Call[list[T]]:
    return _Call(
        "GET",
        path,
        lambda document, _replayed: [read(item) for item in document["data"]],
        None,
        None,
        has_id=False,
    )


def _id(value: str) -> str:
    # An id is one path segment, whatever it holds.
    return quote(value, safe="")


def _present(**fields: Any) -> dict[str, Any]:
    """The fields given: an omitted one takes the API's default."""
    return {name: value for name, value in fields.items() if value is not None}


def _pay(
    amount: int,
    currency: str,
    payment_method: str,
    description: str | None,
    metadata: Mapping[str, str] | None,
    mandate_id: str | None,
    key: str | None,
) -> _Call[Operation]:
    body = _present(
        amount=amount,
        currency=currency,
        payment_method=payment_method,
        description=description,
        metadata=dict(metadata) if metadata else None,
        mandate_id=mandate_id,
    )
    return _keyed("/v1/payments", Operation.of, body, key)


def _refund(
    payment_id: str,
    amount: int | None,
    reason: str | None,
    sandbox_scenario: str | None,
    key: str | None,
) -> _Call[Operation]:
    body = _present(amount=amount, reason=reason, sandbox_scenario=sandbox_scenario)
    return _keyed(f"/v1/payments/{_id(payment_id)}/refunds", Operation.of, body, key)


def _create_mandate(
    currency: str, max_amount: int, total_limit: int, key: str | None
) -> _Call[Mandate]:
    body = {"currency": currency, "max_amount": max_amount, "total_limit": total_limit}
    return _keyed("/v1/mandates", Mandate.of, body, key)


MandateAction = Literal["suspend", "resume", "revoke"]


def _change_mandate(mandate_id: str, action: MandateAction, key: str | None) -> _Call[Mandate]:
    return _keyed(f"/v1/mandates/{_id(mandate_id)}/{action}", Mandate.of, None, key)


def _create_webhook_endpoint(
    url: str, events: list[str] | None, key: str | None
) -> _Call[WebhookEndpoint]:
    body = _present(url=url, events=events)
    return _keyed("/v1/webhook-endpoints", WebhookEndpoint.of, body, key)


def _delete_webhook_endpoint(endpoint_id: str) -> _Call[None]:
    return _Call("DELETE", f"/v1/webhook-endpoints/{_id(endpoint_id)}", lambda _d, _r: None)


def _deliveries(endpoint_id: str, limit: int, starting_after: int | None) -> _Call[DeliveryPage]:
    query = urlencode(_present(limit=limit, starting_after=starting_after))
    path = f"/v1/webhook-endpoints/{_id(endpoint_id)}/deliveries?{query}"
    return _Call("GET", path, lambda document, _replayed: DeliveryPage.of(document), has_id=False)


def _create_beneficiary(
    name: str, iban: str, sandbox_scenario: str | None, key: str | None
) -> _Call[Operation]:
    body = _present(name=name, iban=iban, sandbox_scenario=sandbox_scenario)
    return _keyed("/v1/beneficiaries", Operation.of, body, key)


def _issue_card(label: str | None, sandbox_scenario: str | None, key: str | None) -> _Call[Card]:
    return _keyed(
        "/v1/cards", Card.of, _present(label=label, sandbox_scenario=sandbox_scenario), key
    )


CardAction = Literal["freeze", "unfreeze"]


def _change_card(
    card_id: str, action: CardAction, sandbox_scenario: str | None, key: str | None
) -> _Call[Card]:
    body = _present(sandbox_scenario=sandbox_scenario)
    return _keyed(f"/v1/cards/{_id(card_id)}/{action}", Card.of, body, key)


# -- the sync client ----------------------------------------------------------------------------

# A failure to get a whole answer: retried with the same key.
NO_ANSWER = (httpx.TransportError, httpx.DecodingError)


class Client:
    """Every write takes an optional `idempotency_key` (one is made otherwise)
    and sends it on each retry; an error raised carries it, to call again with."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 15.0,
        retries: Retries | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.retries = retries or Retries()
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # payments and refunds

    def pay(
        self,
        amount: int,
        currency: str,
        payment_method: str,
        *,
        description: str | None = None,
        metadata: Mapping[str, str] | None = None,
        mandate_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Operation:
        call = _pay(
            amount, currency, payment_method, description, metadata, mandate_id, idempotency_key
        )
        return self._call(call)

    def refund(
        self,
        payment_id: str,
        amount: int | None = None,
        *,
        reason: str | None = None,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Operation:
        """Refund a succeeded payment: `amount` minor units, or (None) all that is
        still refundable. The refund is an operation of kind `refund`: `wait` for it."""
        return self._call(_refund(payment_id, amount, reason, sandbox_scenario, idempotency_key))

    def refunds(self, payment_id: str) -> list[Operation]:
        """A payment's refunds, oldest first."""
        return self._call(_get_list(f"/v1/payments/{_id(payment_id)}/refunds", Operation.of))

    def operation(self, operation_id: str) -> Operation:
        return self._call(_get(f"/v1/operations/{_id(operation_id)}", Operation.of))

    def events(self, operation_id: str) -> list[TimelineEvent]:
        """The operation's timeline, in time order."""
        path = f"/v1/operations/{_id(operation_id)}/events"
        return self._call(_get_list(path, TimelineEvent.of))

    def wait(self, operation_id: str, timeout: float, poll: float = 0.5) -> Operation:
        """The operation once its outcome is known or a person is needed; at
        `timeout`, as it was last seen (possibly still UNKNOWN: that is an
        answer too). Each look is bounded by the time left; one that fails is
        followed by another until then."""
        deadline = time.monotonic() + timeout
        seen: Operation | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                response = self._http.get(
                    f"/v1/operations/{_id(operation_id)}", timeout=max(0.1, left)
                )
                if not _retryable(response):
                    seen = _read(Operation.of, _document(response, None), None)
                    if seen.settled or seen.needs_a_person:
                        return seen
            except NO_ANSWER as exc:
                if time.monotonic() >= deadline and seen is None:
                    raise GaveUp("(none: a read)", exc) from exc
            if time.monotonic() >= deadline:
                if seen is None:
                    raise GaveUp("(none: a read)", RuntimeError("no readable answer in time"))
                return seen
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    # mandates

    def create_mandate(
        self,
        currency: str,
        max_amount: int,
        total_limit: int,
        *,
        idempotency_key: str | None = None,
    ) -> Mandate:
        return self._call(_create_mandate(currency, max_amount, total_limit, idempotency_key))

    def mandate(self, mandate_id: str) -> Mandate:
        return self._call(_get(f"/v1/mandates/{_id(mandate_id)}", Mandate.of))

    def suspend_mandate(self, mandate_id: str, *, idempotency_key: str | None = None) -> Mandate:
        """Suspend; payments under it not yet submitted are cancelled."""
        return self._call(_change_mandate(mandate_id, "suspend", idempotency_key))

    def resume_mandate(self, mandate_id: str, *, idempotency_key: str | None = None) -> Mandate:
        return self._call(_change_mandate(mandate_id, "resume", idempotency_key))

    def revoke_mandate(self, mandate_id: str, *, idempotency_key: str | None = None) -> Mandate:
        """Revoke for good; payments under it not yet submitted are cancelled."""
        return self._call(_change_mandate(mandate_id, "revoke", idempotency_key))

    # webhook endpoints

    def create_webhook_endpoint(
        self, url: str, events: list[str] | None = None, *, idempotency_key: str | None = None
    ) -> WebhookEndpoint:
        """Register where this actor's events go; the answer carries the signing secret."""
        return self._call(_create_webhook_endpoint(url, events, idempotency_key))

    def webhook_endpoints(self) -> list[WebhookEndpoint]:
        return self._call(_get_list("/v1/webhook-endpoints", WebhookEndpoint.of))

    def webhook_endpoint(self, endpoint_id: str) -> WebhookEndpoint:
        return self._call(_get(f"/v1/webhook-endpoints/{_id(endpoint_id)}", WebhookEndpoint.of))

    def delete_webhook_endpoint(self, endpoint_id: str) -> None:
        """Stop sending to it; what it has not received is cancelled. Deleting
        a deleted endpoint changes nothing, so a retry whose first answer was
        lost succeeds; NotFound if the actor never had it."""
        self._call(_delete_webhook_endpoint(endpoint_id))

    def deliveries(
        self, endpoint_id: str, *, limit: int = 20, starting_after: int | None = None
    ) -> DeliveryPage:
        """One page of the events sent to an endpoint, newest first."""
        return self._call(_deliveries(endpoint_id, limit, starting_after))

    # beneficiaries and cards (the provider answers within the request)

    def create_beneficiary(
        self,
        name: str,
        iban: str,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Operation:
        """The creation's operation: OUTCOME_KNOWN, or UNKNOWN if the provider's
        answer was lost (then reconciled like a payment)."""
        return self._call(_create_beneficiary(name, iban, sandbox_scenario, idempotency_key))

    def issue_card(
        self,
        label: str | None = None,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Card:
        return self._call(_issue_card(label, sandbox_scenario, idempotency_key))

    def card(self, card_id: str) -> Card:
        return self._call(_get(f"/v1/cards/{_id(card_id)}", Card.of))

    def freeze_card(
        self,
        card_id: str,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Card:
        return self._call(_change_card(card_id, "freeze", sandbox_scenario, idempotency_key))

    def unfreeze_card(
        self,
        card_id: str,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Card:
        return self._call(_change_card(card_id, "unfreeze", sandbox_scenario, idempotency_key))

    def _call(self, call: _Call[T]) -> T:
        return call.answer(self._send(call.method, call.path, call.body, call.key))

    def _send(
        self, method: str, path: str, body: Any = None, key: str | None = None
    ) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key is not None else {}
        last: BaseException | None = None
        for attempt in range(1, self.retries.attempts + 1):
            response: httpx.Response | None = None
            try:
                response = self._http.request(method, path, json=body, headers=headers)
                if not _retryable(response) or attempt == self.retries.attempts:
                    return response
            except NO_ANSWER as exc:
                last = exc
                if attempt == self.retries.attempts:
                    break
            wait = self.retries.delay(attempt, response)
            if wait is None:
                assert response is not None
                return response  # asked to wait longer than we will: the caller hears it
            time.sleep(wait)
        raise GaveUp(key or "(none: a read or a delete)", last or RuntimeError("no answer"))


# -- the async client ---------------------------------------------------------------------------


class AsyncClient:
    """As `Client`, for asyncio."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        timeout: float = 15.0,
        retries: Retries | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.retries = retries or Retries()
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # payments and refunds

    async def pay(
        self,
        amount: int,
        currency: str,
        payment_method: str,
        *,
        description: str | None = None,
        metadata: Mapping[str, str] | None = None,
        mandate_id: str | None = None,
        idempotency_key: str | None = None,
    ) -> Operation:
        call = _pay(
            amount, currency, payment_method, description, metadata, mandate_id, idempotency_key
        )
        return await self._call(call)

    async def refund(
        self,
        payment_id: str,
        amount: int | None = None,
        *,
        reason: str | None = None,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Operation:
        """As `Client.refund`."""
        call = _refund(payment_id, amount, reason, sandbox_scenario, idempotency_key)
        return await self._call(call)

    async def refunds(self, payment_id: str) -> list[Operation]:
        return await self._call(_get_list(f"/v1/payments/{_id(payment_id)}/refunds", Operation.of))

    async def operation(self, operation_id: str) -> Operation:
        return await self._call(_get(f"/v1/operations/{_id(operation_id)}", Operation.of))

    async def events(self, operation_id: str) -> list[TimelineEvent]:
        path = f"/v1/operations/{_id(operation_id)}/events"
        return await self._call(_get_list(path, TimelineEvent.of))

    async def wait(self, operation_id: str, timeout: float, poll: float = 0.5) -> Operation:  # noqa: ASYNC109
        """As `Client.wait`."""
        deadline = time.monotonic() + timeout
        seen: Operation | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                response = await self._http.get(
                    f"/v1/operations/{_id(operation_id)}", timeout=max(0.1, left)
                )
                if not _retryable(response):
                    seen = _read(Operation.of, _document(response, None), None)
                    if seen.settled or seen.needs_a_person:
                        return seen
            except NO_ANSWER as exc:
                if time.monotonic() >= deadline and seen is None:
                    raise GaveUp("(none: a read)", exc) from exc
            if time.monotonic() >= deadline:
                if seen is None:
                    raise GaveUp("(none: a read)", RuntimeError("no readable answer in time"))
                return seen
            await asyncio.sleep(min(poll, max(0.0, deadline - time.monotonic())))

    # mandates

    async def create_mandate(
        self,
        currency: str,
        max_amount: int,
        total_limit: int,
        *,
        idempotency_key: str | None = None,
    ) -> Mandate:
        call = _create_mandate(currency, max_amount, total_limit, idempotency_key)
        return await self._call(call)

    async def mandate(self, mandate_id: str) -> Mandate:
        return await self._call(_get(f"/v1/mandates/{_id(mandate_id)}", Mandate.of))

    async def suspend_mandate(
        self, mandate_id: str, *, idempotency_key: str | None = None
    ) -> Mandate:
        return await self._call(_change_mandate(mandate_id, "suspend", idempotency_key))

    async def resume_mandate(
        self, mandate_id: str, *, idempotency_key: str | None = None
    ) -> Mandate:
        return await self._call(_change_mandate(mandate_id, "resume", idempotency_key))

    async def revoke_mandate(
        self, mandate_id: str, *, idempotency_key: str | None = None
    ) -> Mandate:
        return await self._call(_change_mandate(mandate_id, "revoke", idempotency_key))

    # webhook endpoints

    async def create_webhook_endpoint(
        self, url: str, events: list[str] | None = None, *, idempotency_key: str | None = None
    ) -> WebhookEndpoint:
        """Register where this actor's events go; the answer carries the signing secret."""
        return await self._call(_create_webhook_endpoint(url, events, idempotency_key))

    async def webhook_endpoints(self) -> list[WebhookEndpoint]:
        return await self._call(_get_list("/v1/webhook-endpoints", WebhookEndpoint.of))

    async def webhook_endpoint(self, endpoint_id: str) -> WebhookEndpoint:
        path = f"/v1/webhook-endpoints/{_id(endpoint_id)}"
        return await self._call(_get(path, WebhookEndpoint.of))

    async def delete_webhook_endpoint(self, endpoint_id: str) -> None:
        """As `Client.delete_webhook_endpoint`."""
        await self._call(_delete_webhook_endpoint(endpoint_id))

    async def deliveries(
        self, endpoint_id: str, *, limit: int = 20, starting_after: int | None = None
    ) -> DeliveryPage:
        return await self._call(_deliveries(endpoint_id, limit, starting_after))

    # beneficiaries and cards

    async def create_beneficiary(
        self,
        name: str,
        iban: str,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Operation:
        call = _create_beneficiary(name, iban, sandbox_scenario, idempotency_key)
        return await self._call(call)

    async def issue_card(
        self,
        label: str | None = None,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Card:
        return await self._call(_issue_card(label, sandbox_scenario, idempotency_key))

    async def card(self, card_id: str) -> Card:
        return await self._call(_get(f"/v1/cards/{_id(card_id)}", Card.of))

    async def freeze_card(
        self,
        card_id: str,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Card:
        call = _change_card(card_id, "freeze", sandbox_scenario, idempotency_key)
        return await self._call(call)

    async def unfreeze_card(
        self,
        card_id: str,
        *,
        sandbox_scenario: str | None = None,
        idempotency_key: str | None = None,
    ) -> Card:
        call = _change_card(card_id, "unfreeze", sandbox_scenario, idempotency_key)
        return await self._call(call)

    async def _call(self, call: _Call[T]) -> T:
        return call.answer(await self._send(call.method, call.path, call.body, call.key))

    async def _send(
        self, method: str, path: str, body: Any = None, key: str | None = None
    ) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key is not None else {}
        last: BaseException | None = None
        for attempt in range(1, self.retries.attempts + 1):
            response: httpx.Response | None = None
            try:
                response = await self._http.request(method, path, json=body, headers=headers)
                if not _retryable(response) or attempt == self.retries.attempts:
                    return response
            except NO_ANSWER as exc:
                last = exc
                if attempt == self.retries.attempts:
                    break
            wait = self.retries.delay(attempt, response)
            if wait is None:
                assert response is not None
                return response
            await asyncio.sleep(wait)
        raise GaveUp(key or "(none: a read or a delete)", last or RuntimeError("no answer"))


# -- merchant webhooks ----------------------------------------------------------------------------


class WebhookRefused(ValueError):
    """A merchant webhook whose Standard Webhooks signature does not verify."""


def verify_webhook(
    headers: Mapping[str, str],
    body: bytes,
    secret: str,
    *,
    now: float | None = None,
    tolerance: int = WEBHOOK_TOLERANCE_SECONDS,
) -> Any:
    """The JSON payload of a webhook signed per the Standard Webhooks
    specification (`webhook-id`, `webhook-timestamp`, `webhook-signature:
    v1,<base64>`; HMAC-SHA256 over "id.timestamp.body" with the base64 key
    after `whsec_`), or WebhookRefused."""
    lowered = {name.lower(): value for name, value in headers.items()}
    try:
        verify_standard_signature(
            lowered.get("webhook-id"),
            lowered.get("webhook-timestamp"),
            lowered.get("webhook-signature"),
            body,
            secret,
            time.time() if now is None else now,
            tolerance,
        )
    except SignatureRefused as exc:
        raise WebhookRefused(str(exc)) from exc
    try:
        return json.loads(body)
    except ValueError as exc:
        raise WebhookRefused("the signed body is not JSON") from exc


def is_newer(event: Mapping[str, Any], last_seen_version: int | None) -> bool:
    """Whether a merchant event (the payload `verify_webhook` returns) shows its
    object at a later version than the last one acted on (None: none yet).

    Deliveries are not ordered and are retried, so an event may arrive after a
    newer one about the same object: keep, per object id, the highest `version`
    acted on and drop an event that is not newer. Events of one change share
    its version (and its `data`): act on that data once."""
    try:
        version = _integer(event["data"]["version"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the event carries no integer data.version: {exc}") from exc
    return last_seen_version is None or version > last_seen_version
