"""The Adyen adapter: the Checkout API v71, in Adyen's own wire format (JSON,
`X-API-Key`, `Idempotency-Key`).

Our own HTTP calls, as for Stripe: transport is classified by the shared code
(providers/http.py), and what each Adyen answer proves is the mapping below,
documented with its reasons in docs/providers.md (a test holds the two together).
What the mapping rests on, page by page:

- the result codes of a `/payments` answer and which of them are final:
  https://docs.adyen.com/online-payments/build-your-integration/payment-result-codes
  and `PaymentResponse.resultCode` in the v71 reference
  (https://docs.adyen.com/api-explorer/Checkout/71/post/payments), whose
  description (tests/adyen_openapi/) also lists `Success` without a meaning;
- HTTP statuses, "400: do not repeat the request without first modifying it",
  422 a validation error, 500 possibly after processing:
  https://docs.adyen.com/development-resources/response-handling;
- the error body (`status`, `errorCode`, `message`, `errorType`):
  https://docs.adyen.com/development-resources/error-codes and
  https://docs.adyen.com/errors/unprocessable-entity;
- idempotency: the first answer replayed under the same key, errorCode 704
  ("request already processed or in progress") for a resend while the first
  runs, keys kept for a minimum of 7 days by one version of the page and 31 by
  another (domain/retention.py takes the shorter):
  https://docs.adyen.com/development-resources/api-idempotency;
- refunds, answered `received` with the outcome only ever a REFUND or
  REFUND_FAILED notification: https://docs.adyen.com/online-payments/refund;
- stored cards charged by the merchant (`shopperReference`,
  `storedPaymentMethodId`, `recurringProcessingModel`, `shopperInteraction`):
  https://docs.adyen.com/online-payments/tokenization.

**No lookup.** The Checkout API cannot be asked what became of a request by our
reference: the plug-in declares `LookupConsistency(available=False)` and
`lookup` refuses to run. A lost answer is recovered by a resend under the same
key while Adyen still keeps it, or by a signed notification.

The API key goes only into the `X-API-Key` header: never into a log, an
observation or an error text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlsplit

from intentledger.domain.adyen_signatures import HEX_KEY
from intentledger.domain.retention import REGISTRY
from intentledger.domain.transport import (
    Classification,
    LookupAnswer,
    ProviderAnswer,
    Transport,
    Verdict,
)
from intentledger.providers.adyen_notifications import AdyenNotifications, hmac_keys
from intentledger.providers.base import LookupConsistency, ProviderLookup, ProviderRequest
from intentledger.providers.http import ProviderClient, call_deadline, error_fields, observe
from intentledger.providers.registry import BuildArguments, ProviderConfig, ProviderPlugin

# Pinned in the path, so a new version of the API cannot change what an answer means.
API_VERSION = "v71"
# Answer headers kept in the observation: Adyen's reference of the request (what
# Adyen support asks for), the key echoed back, and the transient-error hint.
KEPT_HEADERS = ("pspReference", "Idempotency-Key", "Transient-Error")
# v71 requires a `returnUrl`, where a redirected shopper would come back. No
# shopper is ever sent anywhere by this adapter (a shopper-action answer is a
# failure), so it names a host that cannot exist (RFC 2606's `.invalid`).
RETURN_URL = "https://intentledger.invalid/adyen/no-shopper-redirect"
# `payment_method` for Adyen: `<shopperReference>:<storedPaymentMethodId>`.
STORED_CARD_SEPARATOR = ":"
# A payment under a mandate is charged by the merchant at times and amounts the
# mandate allows, on no fixed schedule: Adyen's "unscheduled card-on-file"
# (`Subscription` would promise a fixed schedule, which a mandate does not have).
MANDATE_PROCESSING_MODEL = "UnscheduledCardOnFile"
# Without a mandate the shopper is taken as present, as Stripe's confirmation is
# on-session: a one-click card-on-file payment.
SHOPPER_PROCESSING_MODEL = "CardOnFile"


@dataclass(frozen=True)
class ResultCode:
    """What an answer in one result code (or refund status) proves."""

    verdict: Verdict
    why: str


_NOBODY_ACTS = (
    "and nobody will act on a server-side payment (the action is never passed on): "
    "it never succeeds; a later success arrives as late evidence and is flagged"
)
_AUTHENTICATION_ONLY = (
    "an answer of Adyen's authentication-only flow, never asked for here: no "
    "authorisation was made, and none will be under this pspReference; a later success "
    "arrives as late evidence and is flagged"
)

# docs/providers.md, "Adyen result codes", is this table with its reasons.
RESULT_CODES: dict[str, ResultCode] = {
    "Authorised": ResultCode(
        Verdict.SUCCEEDED, "authorised for the amount asked: Adyen's final success"
    ),
    "Refused": ResultCode(
        Verdict.FAILED, "refused by the issuer or Adyen's risk checks (refusalReason): final"
    ),
    "Error": ResultCode(
        Verdict.FAILED,
        "an error ended the processing (refusalReason): Adyen documents Error as a final "
        "state and notifies AUTHORISATION success=false, so nothing was authorised; a "
        "later success arrives as late evidence and is flagged",
    ),
    "Cancelled": ResultCode(
        Verdict.FAILED, "cancelled before processing completed: final, nothing authorised"
    ),
    "Pending": ResultCode(
        Verdict.PENDING,
        "Adyen cannot give the final status yet: an AUTHORISATION notification will",
    ),
    "Received": ResultCode(
        Verdict.PENDING,
        "received by Adyen and still to be processed: the outcome comes by notification",
    ),
    "PartiallyAuthorised": ResultCode(
        Verdict.UNKNOWN,
        "authorised for part of the amount only: not the payment asked (never succeeded "
        "for the full amount), yet money is held (not failed); a person decides whether to "
        "cancel it at Adyen or accept the part",
    ),
    "RedirectShopper": ResultCode(
        Verdict.FAILED, f"the shopper must be redirected (3-D Secure, a wallet) {_NOBODY_ACTS}"
    ),
    "IdentifyShopper": ResultCode(
        Verdict.FAILED, f"the issuer wants the shopper's device fingerprint {_NOBODY_ACTS}"
    ),
    "ChallengeShopper": ResultCode(
        Verdict.FAILED, f"the issuer challenges the shopper (3-D Secure) {_NOBODY_ACTS}"
    ),
    "PresentToShopper": ResultCode(
        Verdict.FAILED,
        f"something (a voucher, a QR code) must be shown to the shopper {_NOBODY_ACTS}",
    ),
    "AuthenticationFinished": ResultCode(Verdict.FAILED, _AUTHENTICATION_ONLY),
    "AuthenticationNotRequired": ResultCode(Verdict.FAILED, _AUTHENTICATION_ONLY),
    "Success": ResultCode(
        Verdict.UNKNOWN,
        "listed by v71's description with no meaning given for a payment: proves nothing",
    ),
}

# docs/providers.md, "Adyen refund answers", is this table with its reasons.
REFUND_STATUSES: dict[str, ResultCode] = {
    "received": ResultCode(
        Verdict.PENDING,
        "received, never more: Adyen refunds asynchronously and the outcome is only ever "
        "a REFUND or REFUND_FAILED notification, so the amount stays held",
    ),
}

# ErrorRule.error_code: match any answer of the status, with or without an errorCode...
ANY = "any"
# ...or only one that carries an errorCode (Adyen's error body, not a proxy's page).
SOME_CODE = "an errorCode"


@dataclass(frozen=True)
class ErrorRule:
    """What an Adyen error answer proves: by HTTP status and, where it matters,
    its `errorCode`."""

    status: int | range
    error_code: str  # a code, SOME_CODE or ANY
    verdict: Verdict
    why: str

    def matches(self, status: int, error: dict[str, str]) -> bool:
        in_status = (
            status in self.status if isinstance(self.status, range) else status == self.status
        )
        code = error.get("errorCode")
        if self.error_code == ANY:
            wanted = True
        elif self.error_code == SOME_CODE:
            wanted = bool(code)
        else:
            wanted = code == self.error_code
        return in_status and wanted


# First match wins. docs/providers.md, "Adyen error answers", is this table.
ERROR_RULES: tuple[ErrorRule, ...] = (
    ErrorRule(
        422,
        "704",
        Verdict.KEY_CONFLICT,
        "request already processed or in progress: a request under the key is still "
        "executing, or the key came with another body; what it did is not this answer",
    ),
    ErrorRule(
        409,
        ANY,
        Verdict.KEY_CONFLICT,
        "a conflict: versions of Adyen's idempotency page give the in-progress answer as 409",
    ),
    ErrorRule(
        422,
        SOME_CODE,
        Verdict.FAILED,
        "a validation error: the request was refused as it stands and nothing was created",
    ),
    ErrorRule(
        400,
        SOME_CODE,
        Verdict.FAILED,
        "the request could not be read: nothing was created, and Adyen says not to repeat "
        "it unchanged",
    ),
    ErrorRule(
        401,
        ANY,
        Verdict.MISCONFIGURED,
        "the API key was refused before processing; sending again will be refused again: "
        "a person fixes the key",
    ),
    ErrorRule(
        403,
        ANY,
        Verdict.MISCONFIGURED,
        "refused before processing (the key's roles, or a merchant account it may not use): "
        "a person fixes the configuration",
    ),
    ErrorRule(
        404,
        ANY,
        Verdict.MISCONFIGURED,
        "unrecognised URL: nothing was created, and every request would meet the same "
        "answer (a wrong INTENTLEDGER_ADYEN_API_BASE): a person fixes it",
    ),
    ErrorRule(
        429,
        ANY,
        Verdict.NOT_EXECUTED,
        "rate limited before processing: sent again with the same key no earlier than Retry-After",
    ),
    ErrorRule(
        range(500, 600),
        ANY,
        Verdict.UNKNOWN,
        "Adyen's servers failed: the request may or may not have been processed (Adyen "
        "answers 500 even for some invalid requests)",
    ),
)


def map_payment_answer(answer: ProviderAnswer) -> Classification:
    """What one Adyen answer to `/payments` proves. A result code or an error
    this module does not name proves nothing: never success, never failure."""
    status = answer.status
    assert status is not None, "only a response is mapped"
    if not 200 <= status < 300:
        return map_error(answer)
    body = answer.detail.get("body")
    code = body.get("resultCode") if isinstance(body, dict) else None
    if not isinstance(code, str):
        return Classification(Verdict.UNKNOWN, f"Adyen answered {status} without a resultCode")
    assert isinstance(body, dict)
    psp = body.get("pspReference")
    known = RESULT_CODES.get(code)
    if known is None:
        return Classification(
            Verdict.UNKNOWN, f"payment {psp} is {code!r}: not a documented result code"
        )
    return Classification(known.verdict, f"payment {psp} is {code}{_details(body)}: {known.why}")


def map_refund_answer(answer: ProviderAnswer) -> Classification:
    """What one Adyen answer to `/payments/{pspReference}/refunds` proves."""
    status = answer.status
    assert status is not None, "only a response is mapped"
    if not 200 <= status < 300:
        return map_error(answer)
    body = answer.detail.get("body")
    word = body.get("status") if isinstance(body, dict) else None
    if not isinstance(word, str):
        return Classification(Verdict.UNKNOWN, f"Adyen answered {status} without a refund status")
    assert isinstance(body, dict)
    known = REFUND_STATUSES.get(word)
    refund = f"refund {body.get('pspReference')} of {body.get('paymentPspReference')}"
    if known is None:
        return Classification(Verdict.UNKNOWN, f"{refund} is {word!r}: not a documented status")
    return Classification(known.verdict, f"{refund} is {word}: {known.why}")


def map_error(answer: ProviderAnswer) -> Classification:
    """An error answer, by ERROR_RULES; anything they do not name proves nothing."""
    status = answer.status
    assert status is not None, "only a response is mapped"
    error = error_fields(answer.detail.get("body"))
    words = ", ".join(f"{k}={error[k]}" for k in ("errorCode", "errorType") if k in error)
    said = f"Adyen answered {status}" + (f" ({words})" if words else "")
    for rule in ERROR_RULES:
        if rule.matches(status, error):
            return Classification(rule.verdict, f"{said}: {rule.why}")
    return Classification(Verdict.UNKNOWN, f"{said}: not a documented answer")


def _details(payment: dict[str, Any]) -> str:
    """The refusal reason, or the amount a partial authorisation holds."""
    said = [str(payment[k]) for k in ("refusalReason", "refusalReasonCode") if payment.get(k)]
    amount = payment.get("amount")
    if payment.get("resultCode") == "PartiallyAuthorised" and isinstance(amount, dict):
        said.append(f"{amount.get('value')} {amount.get('currency')} authorised")
    return f" ({', '.join(said)})" if said else ""


class NoLookup(RuntimeError):
    """Adyen cannot be asked what became of a request: a caller asked anyway."""


class AdyenProvider:
    name = "adyen"

    def __init__(
        self,
        api_key: str,
        merchant_account: str,
        api_base: str,
        timeout: timedelta,
        max_connections: int = 200,
    ) -> None:
        self._deadline = call_deadline(timeout).total_seconds()
        self._client = ProviderClient(max_connections, api_base, timeout)
        self._api_key = api_key
        self._merchant_account = merchant_account

    async def submit(self, request: ProviderRequest) -> ProviderAnswer:
        if request.kind == "payment":
            path = f"/{API_VERSION}/payments"
            body = payment_request(request, self._merchant_account)
            mapping = map_payment_answer
        elif request.kind == "refund":
            if not request.target:
                raise ValueError("an Adyen refund needs the pspReference of the payment")
            path = f"/{API_VERSION}/payments/{quote(request.target, safe='')}/refunds"
            body = refund_request(request, self._merchant_account)
            mapping = map_refund_answer
        else:
            raise ValueError(f"provider adyen does not carry {request.kind!r}")
        headers = {"X-API-Key": self._api_key, "Idempotency-Key": request.idempotency_key}
        call = self._client.request("POST", path, json=body, headers=headers)
        answer = await observe(call, self._deadline, mapping=mapping, keep_headers=KEPT_HEADERS)
        return _with_references(recordable(answer, self._api_key))

    async def lookup(self, query: ProviderLookup) -> LookupAnswer:
        raise NoLookup(
            f"Adyen's Checkout API cannot be asked about {query.reference}: the adyen plug-in "
            "declares no lookup (LookupConsistency.available is False), so reconciliation "
            "must use a same-key resend or a notification instead"
        )

    async def aclose(self) -> None:
        await self._client.aclose()


def stored_card(payment_method: str) -> tuple[str | None, str]:
    """`<shopperReference>:<storedPaymentMethodId>` split at its last colon (a
    shopper reference is the merchant's and may hold one; Adyen's ids do not).
    Without a colon the whole is the stored id and no shopper is named: Adyen
    requires one with a stored card, so it refuses the payment."""
    shopper, separator, stored_id = payment_method.rpartition(STORED_CARD_SEPARATOR)
    return (shopper if separator and shopper else None), stored_id


def payment_request(request: ProviderRequest, merchant_account: str) -> dict[str, Any]:
    """A `/payments` request: a stored card of a known shopper, charged by the
    merchant under a mandate, else as a one-click payment of the shopper."""
    body = request.body
    shopper, stored_id = stored_card(str(body["payment_method"]))
    payment: dict[str, Any] = {
        "merchantAccount": merchant_account,
        "reference": request.reference,
        "amount": _amount(request),
        "paymentMethod": {"type": "scheme", "storedPaymentMethodId": stored_id},
        "returnUrl": RETURN_URL,
    }
    if shopper is not None:
        payment["shopperReference"] = shopper
    if request.under_mandate:
        payment["shopperInteraction"] = "ContAuth"
        payment["recurringProcessingModel"] = MANDATE_PROCESSING_MODEL
    else:
        payment["shopperInteraction"] = "Ecommerce"
        payment["recurringProcessingModel"] = SHOPPER_PROCESSING_MODEL
    return payment


def refund_request(request: ProviderRequest, merchant_account: str) -> dict[str, Any]:
    """A refund of the payment `request.target` names; our reference is the
    refund operation's id, which its notifications carry back."""
    return {
        "merchantAccount": merchant_account,
        "reference": request.reference,
        "amount": _amount(request),
    }


def _amount(request: ProviderRequest) -> dict[str, Any]:
    # A refund's body has no currency of its own: it is its payment's.
    currency = request.currency or request.body.get("currency")
    if not currency:
        raise ValueError(f"an Adyen {request.kind} needs its currency")
    return {"value": int(str(request.body["amount"])), "currency": str(currency).upper()}


def _with_references(answer: ProviderAnswer) -> ProviderAnswer:
    """A 2xx answer's pspReference is the provider's reference of what it made
    (a payment, a refund). An error's names only the refused request: not kept."""
    body = answer.detail.get("body")
    if (
        answer.transport is Transport.RESPONSE
        and answer.status is not None
        and 200 <= answer.status < 300
        and isinstance(body, dict)
        and isinstance(body.get("pspReference"), str)
    ):
        answer = replace(answer, provider_reference=body["pspReference"])
    if answer.transport is Transport.RESPONSE and (answer.status or 0) >= 400:
        # Adyen names its refusal `errorCode`: recorded beside the verdict.
        code = error_fields(body).get("errorCode")
        answer = replace(answer, error_code=code or answer.error_code)
    return answer


def recordable(answer: ProviderAnswer, api_key: str) -> ProviderAnswer:
    """The answer as it may be stored and shown: the API key nowhere in it (an
    HTTP library may quote the header it refused in its error text)."""
    if not api_key:
        return answer
    return replace(answer, detail=_without(answer.detail, api_key))


def _without(value: Any, secret: str) -> Any:
    if isinstance(value, str):
        return value.replace(secret, "[redacted]")
    if isinstance(value, dict):
        return {name: _without(item, secret) for name, item in value.items()}
    if isinstance(value, list):
        return [_without(item, secret) for item in value]
    return value


# Adyen's keys hold letters, digits and punctuation; a space or a control
# character (a trailing newline from a secrets file) would make every request
# fail inside the HTTP library, whose error text quotes the header.
_UNSENDABLE = re.compile(r"[\s\x00-\x1f\x7f]")
# The API base names no version: the adapter adds its own.
_VERSIONED = re.compile(r"/v[0-9]+/?$")

CONSISTENCY = LookupConsistency(
    None,
    "the Checkout API cannot be asked what became of a request by our reference: "
    "a lost answer is recovered by resending it under the same Idempotency-Key while "
    "Adyen keeps the key, or by a signed notification",
    available=False,
)


def _problems(config: ProviderConfig) -> list[str]:
    problems: list[str] = []
    key = config.adyen_api_key.get_secret_value() if config.adyen_api_key else ""
    if not key:
        problems.append("INTENTLEDGER_ADYEN_API_KEY is required")
    elif _UNSENDABLE.search(key):
        problems.append(
            "INTENTLEDGER_ADYEN_API_KEY must hold no spaces or control characters "
            "(check for a trailing newline)"
        )
    if not (config.adyen_merchant_account or "").strip():
        problems.append("INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT is required")
    if _VERSIONED.search(urlsplit(config.adyen_api_base).path):
        problems.append(
            "INTENTLEDGER_ADYEN_API_BASE must not name the API version (e.g. "
            f"https://checkout-test.adyen.com): the adapter adds /{API_VERSION}"
        )
    keys = _hmac_keys(config)
    if config.adyen_hmac_keys is not None and not keys:
        problems.append("INTENTLEDGER_ADYEN_HMAC_KEYS is set but holds no key")
    elif not all(HEX_KEY.fullmatch(key) for key in keys):
        # Said without the keys: they are secrets.
        problems.append(
            "INTENTLEDGER_ADYEN_HMAC_KEYS must be hex keys (as the Customer Area shows them), "
            "comma-separated"
        )
    return problems


def _hmac_keys(config: ProviderConfig) -> tuple[str, ...]:
    configured = config.adyen_hmac_keys
    return hmac_keys(configured.get_secret_value() if configured is not None else None)


def _notifications(config: ProviderConfig) -> AdyenNotifications | None:
    """The notification reader, when HMAC keys are configured (else the route
    takes none: an unverifiable notification is never evidence)."""
    keys = _hmac_keys(config)
    return AdyenNotifications(keys, config.adyen_merchant_account) if keys else None


def _build(arguments: BuildArguments) -> AdyenProvider:
    config = arguments.config
    assert config.adyen_api_key is not None, "checked by the plug-in's problems()"
    assert config.adyen_merchant_account is not None, "checked by the plug-in's problems()"
    return AdyenProvider(
        config.adyen_api_key.get_secret_value(),
        config.adyen_merchant_account.strip(),
        config.adyen_api_base,
        arguments.timeout,
        max_connections=arguments.max_connections,
    )


PLUGIN = ProviderPlugin(
    name="adyen",
    summary="Adyen Checkout API v71 (INTENTLEDGER_ADYEN_API_KEY, "
    "INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT)",
    kinds=frozenset({"payment", "refund"}),
    retention=lambda _config: REGISTRY["adyen"],
    consistency=lambda _config: CONSISTENCY,
    build=_build,
    problems=_problems,
    webhooks=_notifications,
)
