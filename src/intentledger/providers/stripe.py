"""The Stripe adapter: PaymentIntents on API v1, in Stripe's own wire format.

Our own HTTP calls, not the `stripe` SDK: the SDK folds a refused connection and a
lost answer into one `APIConnectionError`, so it cannot tell "never sent" from
"sent, answer lost" — the distinction the whole ledger rests on. Transport is
classified by the shared code (providers/http.py); what each Stripe answer
proves is the mapping below, documented with its reasons in docs/providers.md
(a test holds the two together).

Lookups by our reference: a PaymentIntent id some answer gave is retrieved
(strongly consistent); otherwise Stripe's Search, which Stripe documents as
eventually consistent, so "nothing found" within the search lag of the last
attempt is inconclusive. Where Search is missing (a fake Stripe), a bounded
list scan filtered here is the fallback, named so in the observation.

The secret key goes only into the Authorization header: never into a log, an
observation or an error text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from intentledger.domain.retention import REGISTRY
from intentledger.domain.signatures import verify_stripe_signature
from intentledger.domain.transport import (
    ChargeSeen,
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
)
from intentledger.providers.base import (
    LookupConsistency,
    ProviderLookup,
    ProviderRequest,
    UnreadableEvent,
    WebhookEvent,
    read_event_json,
)
from intentledger.providers.http import ProviderClient, call_deadline, error_fields, observe
from intentledger.providers.registry import BuildArguments, ProviderConfig, ProviderPlugin

# Pinned, so a change of Stripe's default version cannot change what an answer means.
STRIPE_VERSION = "2026-10-28.endive"
# The metadata key under which every PaymentIntent carries our operation id.
REFERENCE_KEY = "intentledger_reference"
# Answer headers kept in the observation: Stripe's request id (what Stripe
# support asks for), whether the answer was a stored replay, and its retry hint.
KEPT_HEADERS = ("Request-Id", "Idempotent-Replayed", "Stripe-Should-Retry")
# The fallback list scan reads at most this many pages of 100: past it, an
# absence proves nothing.
SCAN_PAGES = 20
PAGE_SIZE = 100


@dataclass(frozen=True)
class IntentStatus:
    """What a PaymentIntent in one status proves, as a create's answer and in a lookup."""

    verdict: Verdict
    lookup_word: str  # succeeded | failed | canceled | processing (see judge_lookup)
    why: str


# docs/providers.md, "PaymentIntent statuses", is this table with its reasons.
INTENT_STATUSES: dict[str, IntentStatus] = {
    "succeeded": IntentStatus(Verdict.SUCCEEDED, "succeeded", "the payment is complete"),
    "processing": IntentStatus(
        Verdict.PENDING, "processing", "executed or executing; Stripe has not finished"
    ),
    # Only with `last_payment_error`: a confirmation was attempted and declined.
    "requires_payment_method": IntentStatus(
        Verdict.FAILED, "failed", "the confirmation was declined (last_payment_error)"
    ),
    "requires_action": IntentStatus(
        Verdict.FAILED,
        "failed",
        "needs the customer (3-D Secure) and nobody will act on a server-side payment; "
        "never succeeded — a later success arrives as late evidence and is flagged",
    ),
    "requires_confirmation": IntentStatus(
        Verdict.FAILED,
        "failed",
        "not confirmed although confirm=true was sent; never succeeded — a later success "
        "arrives as late evidence and is flagged",
    ),
    "canceled": IntentStatus(Verdict.FAILED, "canceled", "cancelled: it can never succeed"),
}


# docs/providers.md, "Refund statuses", is this table with its reasons.
REFUND_STATUSES: dict[str, IntentStatus] = {
    "succeeded": IntentStatus(Verdict.SUCCEEDED, "succeeded", "the money is on its way back"),
    "pending": IntentStatus(
        Verdict.PENDING, "processing", "created; Stripe has not finished: the amount stays held"
    ),
    "requires_action": IntentStatus(
        Verdict.PENDING,
        "processing",
        "waits on the customer's details (some payment methods); it may still succeed, so "
        "the amount stays held and the checks go on",
    ),
    "failed": IntentStatus(Verdict.FAILED, "failed", "the refund failed: the amount is given back"),
    "canceled": IntentStatus(Verdict.FAILED, "canceled", "cancelled: it will never be paid"),
}


@dataclass(frozen=True)
class ErrorRule:
    """What a Stripe error answer proves: by HTTP status and, where it matters,
    the error's `type` or `code`."""

    status: int | range
    marker: str | None  # an error type or code; None: any
    verdict: Verdict
    why: str

    def matches(self, status: int, error: dict[str, str]) -> bool:
        in_status = (
            status in self.status if isinstance(self.status, range) else (status == self.status)
        )
        markers = {error.get("type"), error.get("code")}
        return in_status and (self.marker is None or self.marker in markers)


# First match wins. docs/providers.md, "Error answers", is this table.
ERROR_RULES: tuple[ErrorRule, ...] = (
    ErrorRule(
        400,
        "idempotency_error",
        Verdict.KEY_CONFLICT,
        "the key was used with other parameters: what it did then is not this answer",
    ),
    ErrorRule(
        409,
        None,
        Verdict.KEY_CONFLICT,
        "idempotency_key_in_use: an earlier request under the key is still executing",
    ),
    ErrorRule(
        402,
        None,
        Verdict.FAILED,
        "card_error: Stripe processed the payment and declined it (authentication_required "
        "included: off-session, Stripe declines instead of asking the customer)",
    ),
    ErrorRule(
        429,
        None,
        Verdict.NOT_EXECUTED,
        "rate_limit: refused before the idempotency layer; sent again with the same key "
        "no earlier than Retry-After",
    ),
    ErrorRule(
        401,
        None,
        Verdict.MISCONFIGURED,
        "authentication_error: refused before processing, and sending again will be refused "
        "again: a person fixes the key",
    ),
    ErrorRule(
        403,
        None,
        Verdict.MISCONFIGURED,
        "permission_error: refused before processing; a person fixes the key's permissions",
    ),
    ErrorRule(
        400,
        "invalid_request_error",
        Verdict.FAILED,
        "invalid_request_error: the parameters were refused; nothing was created",
    ),
    ErrorRule(
        404,
        None,
        Verdict.MISCONFIGURED,
        "unrecognised URL: nothing was created, and every payment would meet the same "
        "answer (a wrong INTENTLEDGER_STRIPE_API_BASE): a person fixes it",
    ),
    ErrorRule(
        range(500, 600),
        None,
        Verdict.UNKNOWN,
        "api_error: Stripe documents a 5xx as indeterminate (it may have executed, and the "
        "key replays the same 5xx)",
    ),
)


def map_refund_answer(answer: ProviderAnswer) -> Classification:
    """What one Stripe answer to a Refund create proves: its status by
    REFUND_STATUSES, an error by ERROR_RULES (as for a PaymentIntent)."""
    status = answer.status
    assert status is not None, "only a response is mapped"
    if not 200 <= status < 300:
        return map_answer(answer)
    body = answer.detail.get("body")
    if not isinstance(body, dict) or body.get("object") != "refund":
        return Classification(Verdict.UNKNOWN, f"Stripe answered {status} without a Refund")
    word = str(body.get("status"))
    known = REFUND_STATUSES.get(word)
    if known is None:
        return Classification(
            Verdict.UNKNOWN, f"Refund {body.get('id')} is {word!r}: not a documented outcome"
        )
    return Classification(known.verdict, f"Refund {body.get('id')} is {word}: {known.why}")


def map_answer(answer: ProviderAnswer) -> Classification:
    """What one Stripe answer to a PaymentIntent create proves. Anything this
    table does not name proves nothing: never success, never failure."""
    status = answer.status
    assert status is not None, "only a response is mapped"
    body = answer.detail.get("body")
    replayed = (
        " (Stripe's stored answer: Idempotent-Replayed)"
        if answer.detail.get("idempotent-replayed") == "true"
        else ""
    )
    if 200 <= status < 300:
        return _intent_answer(body, status, replayed)
    error = error_fields(body)
    for rule in ERROR_RULES:
        if rule.matches(status, error):
            words = ", ".join(
                f"{k}={error[k]}" for k in ("type", "code", "decline_code") if k in error
            )
            return Classification(
                rule.verdict, f"Stripe answered {status} ({words}): {rule.why}{replayed}"
            )
    return Classification(
        Verdict.UNKNOWN, f"Stripe answered {status} ({answer.error_code}): not a documented answer"
    )


def _intent_answer(body: Any, status: int, replayed: str) -> Classification:
    if not isinstance(body, dict) or body.get("object") != "payment_intent":
        return Classification(Verdict.UNKNOWN, f"Stripe answered {status} without a PaymentIntent")
    word = str(body.get("status"))
    known = INTENT_STATUSES.get(word)
    if known is None or (word == "requires_payment_method" and not body.get("last_payment_error")):
        return Classification(
            Verdict.UNKNOWN, f"PaymentIntent {body.get('id')} is {word!r}: not a documented outcome"
        )
    decline = _decline(body)
    return Classification(
        known.verdict, f"PaymentIntent {body.get('id')} is {word}{decline}: {known.why}{replayed}"
    )


def _decline(intent: dict[str, Any]) -> str:
    error = intent.get("last_payment_error")
    if not isinstance(error, dict):
        return ""
    codes = [str(error[k]) for k in ("code", "decline_code") if error.get(k)]
    return f" ({', '.join(codes)})" if codes else ""


def lookup_word(intent: dict[str, Any]) -> str:
    """A PaymentIntent's status in the lookup's words. A status the table does
    not name is marked unmapped, so it can never read as a final word (a future
    status "failed" would otherwise pass for one)."""
    word = str(intent.get("status"))
    known = INTENT_STATUSES.get(word)
    if known is None or (
        word == "requires_payment_method" and not intent.get("last_payment_error")
    ):
        return f"unmapped:{word}"
    return known.lookup_word


def _intent_id(answer: ProviderAnswer) -> str | None:
    """The PaymentIntent an answer names: a 2xx's object, or a decline's
    `error.payment_intent` (Stripe attaches the declined intent)."""
    body = answer.detail.get("body")
    if not isinstance(body, dict):
        return None
    if answer.status is not None and 200 <= answer.status < 300:
        return _pi_id(body)
    error = body.get("error")
    return _pi_id(error.get("payment_intent")) if isinstance(error, dict) else None


def _pi_id(intent: Any) -> str | None:
    """The id of a PaymentIntent object, or None for anything else."""
    if not isinstance(intent, dict) or intent.get("object") != "payment_intent":
        return None
    identifier = intent.get("id")
    return identifier if isinstance(identifier, str) and identifier.startswith("pi_") else None


class StripeProvider:
    name = "stripe"

    def __init__(
        self,
        api_key: str,
        api_base: str,
        timeout: timedelta,
        search_lag: timedelta,
        max_connections: int = 200,
    ) -> None:
        self._deadline = call_deadline(timeout).total_seconds()
        self._client = ProviderClient(max_connections, api_base, timeout)
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}", "Stripe-Version": STRIPE_VERSION}
        self._search_lag = search_lag

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        if request.kind == "refund":
            return await self._refund(request)
        if request.kind != "payment":
            raise ValueError(f"provider stripe does not carry {request.kind!r}")
        call = self._client.request(
            "POST",
            "/v1/payment_intents",
            data=payment_intent_form(request),
            headers={**self._headers, "Idempotency-Key": request.idempotency_key},
        )
        answer = await observe(call, self._deadline, mapping=map_answer, keep_headers=KEPT_HEADERS)
        answer = recordable(answer, self._api_key)
        if answer.transport is Transport.RESPONSE:
            # A decline names its PaymentIntent too: recorded beside the verdict.
            answer = _with_reference(answer, _intent_id(answer))
        return answer

    async def _refund(self, request: ProviderRequest) -> ProviderAnswer:
        """A Refund of the PaymentIntent the payment settled on (its `target`)."""
        if not request.target:
            raise ValueError("a Stripe refund needs the PaymentIntent it reverses")
        form = {
            "payment_intent": request.target,
            "amount": str(request.body["amount"]),
            f"metadata[{REFERENCE_KEY}]": request.reference,
        }
        call = self._client.request(
            "POST",
            "/v1/refunds",
            data=form,
            headers={**self._headers, "Idempotency-Key": request.idempotency_key},
        )
        answer = await observe(
            call, self._deadline, mapping=map_refund_answer, keep_headers=KEPT_HEADERS
        )
        answer = recordable(answer, self._api_key)
        refund = _object(answer, "refund")
        return _with_reference(answer, _re_id(refund) if refund is not None else None)

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        if query.kind == "refund":
            return await self._refund_lookup(query)
        if query.kind != "payment":
            raise ValueError(f"provider stripe does not carry {query.kind!r}")
        seen, done = await self._retrieve_known(query, "/v1/payment_intents", "payment_intent")
        if done is not None:
            return done
        found = await self._by_reference(query.reference)
        merged = {**{c.provider_reference: c for c in found.charges}, **seen}
        return LookupAnswer(
            found.answer,
            tuple(merged.values()),
            readable=found.readable,
            complete=found.complete,
            method=found.method if not seen else f"retrieve by id + {found.method}",
            # What was retrieved by id is consistent; the rest was searched for,
            # and a search lags: the look as a whole is as consistent as its search.
            lag=found.lag,
        )

    async def _by_reference(self, reference: str) -> LookupAnswer:
        query = f"metadata['{REFERENCE_KEY}']:'{reference}'"
        answer = await self._get("/v1/payment_intents/search", {"query": query, "limit": "100"})
        if answer.transport is Transport.RESPONSE and answer.status == 404:
            # No Search here (a Stripe-compatible server without it); asked each
            # time, as it costs one request, so a server that gains it is used.
            return await self._scan(reference)
        # The window counts from the attempt's start; its write may land as late
        # as the end of the call.
        lag = self._search_lag + timedelta(seconds=self._deadline)
        return _listing(answer, reference, "search", lag=lag)

    async def _scan(self, reference: str) -> LookupAnswer:
        """Search is missing: page through the list (consistent, Stripe documents)
        and filter here."""
        method = f"list scan, search unavailable (at most {SCAN_PAGES * PAGE_SIZE})"
        return await self._pages("/v1/payment_intents", {}, reference, method, "payment_intent")

    async def _retrieve_known(
        self, query: ProviderLookup, path: str, kind: str
    ) -> tuple[dict[str, ChargeSeen], LookupAnswer | None]:
        """Retrieve every object an answer named (strongly consistent): what they
        show, and the lookup's whole answer when that is all there is to ask
        (one key sent, not an audit) or a retrieval proved nothing."""
        read = _refund_seen if kind == "refund" else _seen
        seen: dict[str, ChargeSeen] = {}
        last: ProviderAnswer | None = None
        for object_id in query.known:
            answer = await self._get(f"{path}/{object_id}")
            found = _object(answer, kind)
            charge = read(found) if found is not None else None
            if charge is None:
                # A failed call, or a 200 that is not the object: no evidence either way.
                failed = LookupAnswer(answer, readable=False, method=f"retrieve {object_id}")
                return seen, failed
            seen[object_id] = charge
            last = answer
        if query.known and not query.exhaustive:
            assert last is not None
            return seen, LookupAnswer(last, tuple(seen.values()), method="retrieve by id")
        return seen, None

    async def _pages(
        self, path: str, params: dict[str, str], reference: str, method: str, kind: str
    ) -> LookupAnswer:
        """Page through a list (consistent, Stripe documents), keeping the objects
        that carry our reference; past SCAN_PAGES an absence proves nothing."""
        charges: list[ChargeSeen] = []
        page_params = {**params, "limit": str(PAGE_SIZE)}
        answer: ProviderAnswer | None = None
        for _ in range(SCAN_PAGES):
            answer = await self._get(path, page_params)
            page = _listing(answer, reference, method, lag=None, kind=kind)
            if page.answer.status != 200 or not page.readable:
                return page
            charges += page.charges
            body = answer.detail["body"]
            assert isinstance(body, dict)
            data = body.get("data") or []
            if not body.get("has_more") or not data:
                return LookupAnswer(answer, tuple(charges), method=method)
            page_params = {**page_params, "starting_after": str(data[-1].get("id"))}
        assert answer is not None
        return LookupAnswer(answer, tuple(charges), complete=False, method=method)

    async def _refund_lookup(self, query: ProviderLookup) -> LookupAnswer:
        """The refunds of the PaymentIntent that carry our reference: each id an
        answer named, retrieved; then (unless one was found and only one key was
        sent) the PaymentIntent's refunds, listed — a list Stripe keeps
        consistent, so "none of ours" there is an answer, not a lag."""
        seen, done = await self._retrieve_known(query, "/v1/refunds", "refund")
        if done is not None:
            return done
        if not query.target:
            raise ValueError("a Stripe refund lookup needs the PaymentIntent it reverses")
        method = f"list the PaymentIntent's refunds (at most {SCAN_PAGES * PAGE_SIZE})"
        params = {"payment_intent": query.target}
        listed = await self._pages("/v1/refunds", params, query.reference, method, "refund")
        if not _ok(listed.answer) or not listed.readable:
            return listed  # the listing failed: no evidence, whatever was retrieved
        merged = {**{c.provider_reference: c for c in listed.charges}, **seen}
        return replace(listed, charges=tuple(merged.values()))

    async def _get(self, path: str, params: dict[str, str] | None = None) -> ProviderAnswer:
        call = self._client.request("GET", path, params=params, headers=self._headers)
        return recordable(
            await observe(call, self._deadline, keep_headers=KEPT_HEADERS), self._api_key
        )

    async def aclose(self) -> None:
        await self._client.aclose()


# Fields of a PaymentIntent that must not be kept: the client secret lets a
# browser confirm the payment.
UNKEPT_FIELDS = frozenset({"client_secret"})


def recordable(answer: ProviderAnswer, api_key: str) -> ProviderAnswer:
    """The answer as it may be stored and shown: no client secret in any body,
    and the API key nowhere in an error's text (an HTTP library may quote the
    header it refused)."""
    detail = {name: _without_secrets(value) for name, value in answer.detail.items()}
    error = detail.get("error")
    if isinstance(error, str) and api_key in error:
        detail["error"] = error.replace(api_key, "[redacted]")
    return replace(answer, detail=detail)


def _without_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items() if k not in UNKEPT_FIELDS}
    if isinstance(value, list):
        return [_without_secrets(item) for item in value]
    return value


def payment_intent_form(request: ProviderRequest) -> dict[str, str]:
    """A PaymentIntent create, form-encoded with nested keys, confirmed at once."""
    body = request.body
    form = {
        "amount": str(body["amount"]),
        "currency": str(body["currency"]).lower(),
        "payment_method": str(body["payment_method"]),
        "confirm": "true",
        # Confirmed server-side: a method that would redirect the customer is
        # refused at once rather than left waiting for a return_url.
        "automatic_payment_methods[enabled]": "true",
        "automatic_payment_methods[allow_redirects]": "never",
    }
    if request.under_mandate:
        # The customer is not present: Stripe declines (402 authentication_required)
        # rather than waiting for an authentication nobody will give.
        form["off_session"] = "true"
    if body.get("description"):
        form["description"] = str(body["description"])
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        form.update({f"metadata[{key}]": str(value) for key, value in metadata.items()})
    # Ours last: a merchant's metadata cannot hide the reference lookups search by.
    form[f"metadata[{REFERENCE_KEY}]"] = request.reference
    return form


def _with_reference(answer: ProviderAnswer, reference: str | None) -> ProviderAnswer:
    return replace(answer, provider_reference=reference) if reference else answer


def _ok(answer: ProviderAnswer) -> bool:
    return answer.transport is Transport.RESPONSE and answer.status == 200


def _object(answer: ProviderAnswer, kind: str) -> dict[str, Any] | None:
    body = answer.detail.get("body")
    if _ok(answer) and isinstance(body, dict) and body.get("object") == kind:
        return body
    return None


def _seen(intent: dict[str, Any]) -> ChargeSeen | None:
    """A listed PaymentIntent, or None for an item that is not one (no usable id)."""
    identifier = _pi_id(intent)
    if identifier is None:
        return None
    return ChargeSeen(identifier, lookup_word(intent), raw_status=str(intent.get("status")))


def _re_id(refund: Any) -> str | None:
    """The id of a Refund object, or None for anything else."""
    if not isinstance(refund, dict) or refund.get("object") != "refund":
        return None
    identifier = refund.get("id")
    return identifier if isinstance(identifier, str) and identifier.startswith("re_") else None


def refund_lookup_word(refund: dict[str, Any]) -> str:
    word = str(refund.get("status"))
    known = REFUND_STATUSES.get(word)
    return known.lookup_word if known is not None else f"unmapped:{word}"


def _refund_seen(refund: dict[str, Any]) -> ChargeSeen | None:
    identifier = _re_id(refund)
    if identifier is None:
        return None
    return ChargeSeen(identifier, refund_lookup_word(refund), raw_status=str(refund.get("status")))


def _listing(
    answer: ProviderAnswer,
    reference: str,
    method: str,
    lag: timedelta | None,
    kind: str = "payment_intent",
) -> LookupAnswer:
    """The objects (PaymentIntents, or Refunds) of a search or list answer that
    carry our reference."""
    if not _ok(answer):
        return LookupAnswer(answer, method=method)
    body = answer.detail.get("body")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        return LookupAnswer(answer, readable=False, method=method)
    ours = [
        item
        for item in data
        if isinstance(item.get("metadata"), dict)
        and item["metadata"].get(REFERENCE_KEY) == reference
    ]
    read = _refund_seen if kind == "refund" else _seen
    seen = [read(item) for item in ours]
    if any(charge is None for charge in seen):
        # One of ours we cannot name: the listing is no evidence either way.
        return LookupAnswer(answer, readable=False, method=method)
    return LookupAnswer(answer, tuple(c for c in seen if c is not None), method=method, lag=lag)


# A secret or restricted key, and nothing else: a stray newline or space would
# make every request fail inside the HTTP library, whose error text quotes the
# header (and so the key).
API_KEY_SHAPE = re.compile(r"(sk|rk)_[A-Za-z0-9_]+")


# The PaymentIntent events this adapter reads as evidence; any other type is
# stored and acknowledged, and changes nothing.
PAYMENT_INTENT_EVENTS = frozenset(
    {
        "payment_intent.succeeded",
        "payment_intent.payment_failed",
        "payment_intent.processing",
        "payment_intent.canceled",
    }
)
# A Refund's events carry the Refund, our reference in its metadata. (A
# `charge.refunded` event carries the Charge, which names no refund of ours:
# it is stored and acknowledged, and the `refund.*` event beside it is the evidence.)
REFUND_EVENTS = frozenset({"refund.created", "refund.updated", "refund.failed"})


@dataclass(frozen=True)
class StripeWebhooks:
    """Stripe-Signature verification and the event's reading."""

    secrets: tuple[str, ...]

    def read(self, body: bytes, headers: Mapping[str, str], now: datetime) -> WebhookEvent:
        signed = verify_stripe_signature(
            body, headers.get("stripe-signature"), self.secrets, int(now.timestamp())
        )
        event = read_event_json(body)
        if not isinstance(event, dict) or event.get("object") != "event":
            raise UnreadableEvent("the body is not a Stripe event")
        event_id, kind = event.get("id"), event.get("type")
        if not isinstance(event_id, str) or not event_id or not isinstance(kind, str):
            raise UnreadableEvent("the event has no id or type")
        data = event.get("data")
        item = data.get("object") if isinstance(data, dict) else None
        intent = item if isinstance(item, dict) else {}
        metadata = intent.get("metadata")
        reference = metadata.get(REFERENCE_KEY) if isinstance(metadata, dict) else None
        status: str | None = None
        object_kind: str | None = None
        if kind in PAYMENT_INTENT_EVENTS and _pi_id(intent) is not None:
            status, object_kind = lookup_word(intent), "payment"
        elif kind in REFUND_EVENTS and _re_id(intent) is not None:
            status, object_kind = refund_lookup_word(intent), "refund"
        return WebhookEvent(
            event_id=event_id,
            type=kind,
            signed_at=datetime.fromtimestamp(signed, UTC),
            object_id=str(intent["id"]) if "id" in intent else None,
            reference=str(reference) if reference is not None else None,
            status=status,
            payload=_without_secrets(event),
            object_kind=object_kind,
        )


def _webhook_secrets(config: ProviderConfig) -> tuple[str, ...]:
    """The configured webhook secrets: several, comma-separated, while rotating."""
    if config.stripe_webhook_secret is None:
        return ()
    secrets = (s.strip() for s in config.stripe_webhook_secret.get_secret_value().split(","))
    return tuple(s for s in secrets if s)


def _webhooks(config: ProviderConfig) -> StripeWebhooks | None:
    secrets = _webhook_secrets(config)
    return StripeWebhooks(secrets) if secrets else None


def _problems(config: ProviderConfig) -> list[str]:
    key = config.stripe_api_key.get_secret_value() if config.stripe_api_key else ""
    if not key:
        return ["INTENTLEDGER_STRIPE_API_KEY is required"]
    if config.stripe_webhook_secret is not None and not _webhook_secrets(config):
        return ["INTENTLEDGER_STRIPE_WEBHOOK_SECRET is set but holds no secret"]
    if not API_KEY_SHAPE.fullmatch(key):
        # A publishable key (pk_) cannot create payments; say so without echoing it.
        return [
            "INTENTLEDGER_STRIPE_API_KEY must be a secret (sk_) or restricted (rk_) key, "
            "letters, digits and underscores only (check for a trailing newline)"
        ]
    return []


def _build(arguments: BuildArguments) -> StripeProvider:
    config = arguments.config
    assert config.stripe_api_key is not None, "checked by the plug-in's problems()"
    return StripeProvider(
        config.stripe_api_key.get_secret_value(),
        config.stripe_api_base,
        arguments.timeout,
        config.stripe_search_lag,
        max_connections=arguments.max_connections,
    )


PLUGIN = ProviderPlugin(
    name="stripe",
    summary="Stripe PaymentIntents on API v1 (INTENTLEDGER_STRIPE_API_KEY)",
    kinds=frozenset({"payment", "refund"}),
    retention=lambda _config: REGISTRY["stripe-v1"],
    consistency=lambda config: LookupConsistency(
        config.stripe_search_lag,
        "a PaymentIntent an answer named is retrieved (strongly consistent); otherwise "
        "Search by metadata, eventually consistent: nothing found within "
        "INTENTLEDGER_STRIPE_SEARCH_LAG of the last attempt is inconclusive; without "
        "Search, a bounded list scan",
    ),
    build=_build,
    problems=_problems,
    webhooks=_webhooks,
)
