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
- `verify_webhook` checks a merchant webhook's Standard Webhooks signature.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, document: dict[str, Any]) -> Mandate:
        return cls(
            id=document["id"],
            status=document["status"],
            currency=document["currency"],
            max_amount=document["max_amount"],
            total_limit=document["total_limit"],
            reserved=document.get("reserved", 0),
            spent=document.get("spent", 0),
            raw=document,
        )


@dataclass(frozen=True)
class WebhookEndpoint:
    id: str
    url: str
    events: list[str] | None
    # Only in the creation's answer (and its idempotent replay): keep it.
    secret: str | None = field(repr=False)
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def of(cls, document: dict[str, Any]) -> WebhookEndpoint:
        return cls(
            id=document["id"],
            url=document["url"],
            events=document["events"],
            secret=document.get("secret"),
            raw=document,
        )


def _endpoint_body(url: str, events: list[str] | None) -> dict[str, Any]:
    return {"url": url} if events is None else {"url": url, "events": events}


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


def _result(response: httpx.Response, key: str | None = None) -> dict[str, Any]:
    if response.status_code >= 400:
        raise _error_for(response.status_code, _problem(response), key)
    try:
        body = response.json()
    except ValueError:
        body = None
    if not 200 <= response.status_code < 300 or not isinstance(body, dict) or "id" not in body:
        raise BadAnswer(response.status_code, {"detail": response.text[:500]}, key)
    return body


def _read(kind: Callable[[dict[str, Any]], T], body: dict[str, Any], key: str | None) -> T:
    try:
        return kind(body)
    except (KeyError, TypeError) as exc:
        raise BadAnswer(200, {"detail": f"missing or malformed field: {exc}"}, key) from exc


def new_key() -> str:
    return "il-" + secrets.token_urlsafe(18)


def _payment(
    amount: int,
    currency: str,
    payment_method: str,
    description: str | None,
    metadata: Mapping[str, str] | None,
    mandate_id: str | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "amount": amount,
        "currency": currency,
        "payment_method": payment_method,
    }
    if description is not None:
        body["description"] = description
    if metadata:
        body["metadata"] = dict(metadata)
    if mandate_id is not None:
        body["mandate_id"] = mandate_id
    return body


# -- the sync client ----------------------------------------------------------------------------

# A failure to get a whole answer: retried with the same key.
NO_ANSWER = (httpx.TransportError, httpx.DecodingError)


class Client:
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
        body = _payment(amount, currency, payment_method, description, metadata, mandate_id)
        key = idempotency_key or new_key()
        response = self._send("POST", "/v1/payments", body, key)
        return _read(lambda d: Operation.of(d, _replayed(response)), _result(response, key), key)

    def create_mandate(
        self,
        currency: str,
        max_amount: int,
        total_limit: int,
        *,
        idempotency_key: str | None = None,
    ) -> Mandate:
        body = {"currency": currency, "max_amount": max_amount, "total_limit": total_limit}
        key = idempotency_key or new_key()
        response = self._send("POST", "/v1/mandates", body, key)
        return _read(Mandate.of, _result(response, key), key)

    def create_webhook_endpoint(
        self, url: str, events: list[str] | None = None, *, idempotency_key: str | None = None
    ) -> WebhookEndpoint:
        """Register where this actor's events go; the answer carries the signing secret."""
        key = idempotency_key or new_key()
        response = self._send("POST", "/v1/webhook-endpoints", _endpoint_body(url, events), key)
        return _read(WebhookEndpoint.of, _result(response, key), key)

    def operation(self, operation_id: str) -> Operation:
        return _read(
            Operation.of, _result(self._send("GET", f"/v1/operations/{operation_id}")), None
        )

    def mandate(self, mandate_id: str) -> Mandate:
        return _read(Mandate.of, _result(self._send("GET", f"/v1/mandates/{mandate_id}")), None)

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
                response = self._http.get(f"/v1/operations/{operation_id}", timeout=max(0.1, left))
                if not _retryable(response):
                    seen = _read(Operation.of, _result(response), None)
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
        raise GaveUp(key or "(none: a read)", last or RuntimeError("no answer"))


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
        body = _payment(amount, currency, payment_method, description, metadata, mandate_id)
        key = idempotency_key or new_key()
        response = await self._send("POST", "/v1/payments", body, key)
        return _read(lambda d: Operation.of(d, _replayed(response)), _result(response, key), key)

    async def create_mandate(
        self,
        currency: str,
        max_amount: int,
        total_limit: int,
        *,
        idempotency_key: str | None = None,
    ) -> Mandate:
        body = {"currency": currency, "max_amount": max_amount, "total_limit": total_limit}
        key = idempotency_key or new_key()
        response = await self._send("POST", "/v1/mandates", body, key)
        return _read(Mandate.of, _result(response, key), key)

    async def create_webhook_endpoint(
        self, url: str, events: list[str] | None = None, *, idempotency_key: str | None = None
    ) -> WebhookEndpoint:
        """Register where this actor's events go; the answer carries the signing secret."""
        key = idempotency_key or new_key()
        body = _endpoint_body(url, events)
        response = await self._send("POST", "/v1/webhook-endpoints", body, key)
        return _read(WebhookEndpoint.of, _result(response, key), key)

    async def operation(self, operation_id: str) -> Operation:
        response = await self._send("GET", f"/v1/operations/{operation_id}")
        return _read(Operation.of, _result(response), None)

    async def mandate(self, mandate_id: str) -> Mandate:
        response = await self._send("GET", f"/v1/mandates/{mandate_id}")
        return _read(Mandate.of, _result(response), None)

    async def wait(self, operation_id: str, timeout: float, poll: float = 0.5) -> Operation:  # noqa: ASYNC109
        """As `Client.wait`."""
        deadline = time.monotonic() + timeout
        seen: Operation | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                response = await self._http.get(
                    f"/v1/operations/{operation_id}", timeout=max(0.1, left)
                )
                if not _retryable(response):
                    seen = _read(Operation.of, _result(response), None)
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
        raise GaveUp(key or "(none: a read)", last or RuntimeError("no answer"))


def _replayed(response: httpx.Response) -> bool:
    return bool(response.headers.get("idempotent-replayed") == "true")


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
