"""The Adyen adapter over real HTTP: against the suite's Adyen fake
(tests/adyen_fake.py) for every result code and the error shapes the fake
gives, against a stand-in that answers what the fake cannot (429, 5xx, a
proxy's page), and with every request it sends validated against Adyen's
published OpenAPI description of Checkout v71 (openapi-core, as
tests/test_adyen_fake.py validates the fake). Then `serve --provider adyen` on
each database: the key in no observation and no log line."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest
from pydantic import SecretStr

from intentledger.domain.retention import REGISTRY
from intentledger.domain.transport import ProviderAnswer, Transport, Verdict, classify
from intentledger.ports import free_port
from intentledger.providers.adyen import (
    PLUGIN,
    RESULT_CODES,
    RETURN_URL,
    AdyenProvider,
    NoLookup,
    map_payment_answer,
    map_refund_answer,
    recordable,
)
from intentledger.providers.base import ProviderLookup, ProviderRequest
from intentledger.service import provider_config
from intentledger.settings import Settings
from tests.adyen_fake import (
    FAKE_API_KEY,
    FAKE_MERCHANT_ACCOUNT,
    AdyenFake,
    adyen_fake,  # noqa: F401
    fresh_adyen,  # noqa: F401
)
from tests.conftest import BACKENDS, Databases
from tests.support import Process
from tests.test_adyen_fake import ADYEN_HOST, DESCRIPTION
from tests.test_intake_http import create_key

STORED_CARD = "shopper_0001:8415995487234100"
TIMEOUT = timedelta(seconds=5)


def host(fake: AdyenFake) -> str:
    """The fake's host: the adapter adds the version to its paths itself."""
    return fake.api_base.removesuffix("/v71")


def provider_at(
    base: str, api_key: str = FAKE_API_KEY, merchant: str = FAKE_MERCHANT_ACCOUNT
) -> AdyenProvider:
    return AdyenProvider(api_key, merchant, base, TIMEOUT)


def payment(
    reference: str | None = None,
    amount: int = 1000,
    key: str | None = None,
    under_mandate: bool = False,
    method: str = STORED_CARD,
) -> ProviderRequest:
    reference = reference or f"op_{uuid.uuid4().hex[:12]}"
    return ProviderRequest(
        "payment",
        reference,
        key or f"{reference}:1",
        {"amount": amount, "currency": "eur", "payment_method": method},
        under_mandate=under_mandate,
        currency="EUR",
    )


def refund(target: str, amount: int = 400) -> ProviderRequest:
    reference = f"op_{uuid.uuid4().hex[:12]}"
    # As the engine sends it: the refund's body has no currency, the operation has.
    return ProviderRequest(
        "refund", reference, f"{reference}:1", {"amount": amount}, target=target, currency="EUR"
    )


async def send(provider: AdyenProvider, request: ProviderRequest) -> ProviderAnswer:
    try:
        return await provider.submit(request)
    finally:
        await provider.aclose()


# -- result codes against the fake ---------------------------------------------------


@pytest.mark.parametrize("code", list(RESULT_CODES))
async def test_each_result_code_maps_as_documented(fresh_adyen: AdyenFake, code: str) -> None:  # noqa: F811
    fresh_adyen.configure(result_codes=[code])
    request = payment()
    answer = await send(provider_at(host(fresh_adyen)), request)
    (executed,) = fresh_adyen.truth()["payments"]
    assert executed["reference"] == request.reference and executed["resultCode"] == code
    assert answer.status == 200
    assert classify(answer).verdict is RESULT_CODES[code].verdict, answer.mapped
    # The provider's reference of what it made is its pspReference, whatever the code.
    assert answer.provider_reference == executed["pspReference"]
    assert answer.detail["pspreference"] == executed["pspReference"]  # the header, kept


async def test_a_refusal_records_its_reason(fresh_adyen: AdyenFake) -> None:  # noqa: F811
    fresh_adyen.configure(result_codes=["Refused"])
    answer = await send(provider_at(host(fresh_adyen)), payment())
    got = classify(answer)
    assert got.verdict is Verdict.FAILED and "Refused (Refused, 2)" in got.reason


async def test_a_partial_authorisation_is_neither_success_nor_failure(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    fresh_adyen.configure(result_codes=["PartiallyAuthorised"])
    answer = await send(provider_at(host(fresh_adyen)), payment(amount=1000))
    got = classify(answer)
    assert got.verdict is Verdict.UNKNOWN
    assert "500 EUR authorised" in got.reason  # the part held, beside the verdict


async def test_an_unnamed_result_code_from_the_fake_proves_nothing(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    fresh_adyen.configure(result_codes=["Authorised_v72"])
    answer = await send(provider_at(host(fresh_adyen)), payment())
    assert classify(answer).verdict is Verdict.UNKNOWN


# -- error shapes the fake gives -------------------------------------------------------


async def test_a_wrong_api_key_is_misconfigured(fresh_adyen: AdyenFake) -> None:  # noqa: F811
    answer = await send(provider_at(host(fresh_adyen), api_key="AQE_wrong_key"), payment())
    assert (answer.status, classify(answer).verdict) == (401, Verdict.MISCONFIGURED)
    assert answer.error_code == "000"
    assert fresh_adyen.truth()["payments"] == []


async def test_a_merchant_account_the_key_may_not_use_is_misconfigured(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    answer = await send(provider_at(host(fresh_adyen), merchant="SomeoneElseECOM"), payment())
    assert (answer.status, answer.error_code) == (403, "901")
    assert classify(answer).verdict is Verdict.MISCONFIGURED


async def test_a_wrong_api_base_is_misconfigured(fresh_adyen: AdyenFake) -> None:  # noqa: F811
    # The version given twice (/v71/v71/payments): no such URL.
    answer = await send(provider_at(fresh_adyen.api_base), payment())
    assert (answer.status, classify(answer).verdict) == (404, Verdict.MISCONFIGURED)


@pytest.mark.parametrize("status", [422, 409])
async def test_a_resend_while_the_first_runs_is_a_key_conflict(
    fresh_adyen: AdyenFake,  # noqa: F811
    status: int,
) -> None:
    fresh_adyen.configure(execution_seconds=1.0, in_progress_status=status)
    request = payment()
    first_provider, second_provider = provider_at(host(fresh_adyen)), provider_at(host(fresh_adyen))
    first = asyncio.create_task(send(first_provider, request))
    await asyncio.sleep(0.3)
    during = await send(second_provider, request)
    assert (during.status, during.error_code) == (status, "704")
    assert classify(during).verdict is Verdict.KEY_CONFLICT
    assert during.provider_reference is None  # the refused request made nothing
    assert classify(await first).verdict is Verdict.SUCCEEDED
    assert len(fresh_adyen.truth()["payments"]) == 1


async def test_a_key_reused_with_another_body_is_a_key_conflict(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    request = payment(amount=1000)
    await send(provider_at(host(fresh_adyen)), request)
    other = await send(provider_at(host(fresh_adyen)), payment(request.reference, amount=999))
    assert (other.status, classify(other).verdict) == (422, Verdict.KEY_CONFLICT)
    assert len(fresh_adyen.truth()["payments"]) == 1


async def test_a_validation_error_is_a_failure(fresh_adyen: AdyenFake) -> None:  # noqa: F811
    # A refund of a payment Adyen does not know: 422, errorCode 167.
    answer = await send(provider_at(host(fresh_adyen)), refund("8800000000000000"))
    assert (answer.status, answer.error_code) == (422, "167")
    assert classify(answer).verdict is Verdict.FAILED
    assert fresh_adyen.truth()["refunds"] == []


# -- the same key twice ------------------------------------------------------------------


async def test_the_same_key_twice_replays_the_first_answer(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    request = payment()
    first = await send(provider_at(host(fresh_adyen)), request)
    fresh_adyen.advance_clock(7 * 24 * 3600 - 60)  # inside Adyen's retention
    again = await send(provider_at(host(fresh_adyen)), request)
    assert again.provider_reference == first.provider_reference
    assert classify(again).verdict is classify(first).verdict is Verdict.SUCCEEDED
    assert again.detail["idempotency-key"] == request.idempotency_key
    assert len(fresh_adyen.truth()["payments"]) == 1


async def test_past_the_retention_the_same_key_executes_again(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    """Why the adapter declares Adyen's retention: past it a resend is a new payment."""
    request = payment()
    first = await send(provider_at(host(fresh_adyen)), request)
    fresh_adyen.advance_clock(REGISTRY["adyen"].minimum.total_seconds() + 1)
    again = await send(provider_at(host(fresh_adyen)), request)
    assert again.provider_reference != first.provider_reference
    assert len(fresh_adyen.truth()["payments"]) == 2


# -- refunds -----------------------------------------------------------------------------


async def test_a_received_refund_is_pending_never_succeeded(
    fresh_adyen: AdyenFake,  # noqa: F811
) -> None:
    paid = await send(provider_at(host(fresh_adyen)), payment())
    assert paid.provider_reference is not None
    request = refund(paid.provider_reference, amount=400)
    answer = await send(provider_at(host(fresh_adyen)), request)
    (executed,) = fresh_adyen.truth()["refunds"]
    assert answer.status == 201
    assert classify(answer).verdict is Verdict.PENDING
    assert answer.provider_reference == executed["pspReference"] != paid.provider_reference
    assert executed["paymentPspReference"] == paid.provider_reference
    assert executed["reference"] == request.reference
    assert executed["amount"] == {"value": 400, "currency": "EUR"}


# -- what the table does not name ----------------------------------------------------------


def _response(status: int, body: Any) -> ProviderAnswer:
    return ProviderAnswer(Transport.RESPONSE, status=status, detail={"body": body})


@given(code=st.text(max_size=40).filter(lambda c: c not in RESULT_CODES))
def test_a_result_code_the_table_does_not_name_is_never_an_outcome(code: str) -> None:
    body = {"pspReference": "8800000000000001", "resultCode": code}
    for status in (200, 201, 202):
        assert map_payment_answer(_response(status, body)).verdict is Verdict.UNKNOWN


@given(word=st.one_of(st.sampled_from(["succeeded", "success", "refunded"]), st.text(max_size=30)))
def test_a_refund_status_other_than_received_is_never_an_outcome(word: str) -> None:
    got = map_refund_answer(_response(201, {"pspReference": "8800000000000002", "status": word}))
    assert got.verdict is (Verdict.PENDING if word == "received" else Verdict.UNKNOWN)


NAMED_HTTP = {400, 401, 403, 404, 409, 422, 429}


@given(
    status=st.integers(100, 599).filter(
        lambda s: s not in NAMED_HTTP and not 200 <= s < 300 and not 500 <= s < 600
    ),
    code=st.one_of(st.none(), st.sampled_from(["704", "000", "901"]), st.text(max_size=6)),
)
def test_an_error_the_table_does_not_name_proves_nothing(status: int, code: str | None) -> None:
    body = {"status": status, "message": "m"} | ({"errorCode": code} if code is not None else {})
    for mapping in (map_payment_answer, map_refund_answer):
        assert mapping(_response(status, body)).verdict is Verdict.UNKNOWN


@given(body=st.one_of(st.none(), st.text(max_size=20), st.lists(st.integers()), st.just({})))
def test_a_2xx_without_a_result_is_never_an_outcome(body: Any) -> None:
    assert map_payment_answer(_response(200, body)).verdict is Verdict.UNKNOWN
    assert map_refund_answer(_response(201, body)).verdict is Verdict.UNKNOWN


# -- a stand-in for what the fake cannot answer ------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StandIn:
    """Answers each request with the next canned (status, body, headers), and
    records each request as it arrived."""

    base: str
    answers: list[tuple[int, Any, dict[str, str]]] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(
            Seen(request.method, request.path, dict(request.headers), await request.read())
        )
        status, body, headers = (
            self.answers.pop(0)
            if self.answers
            else (200, {"pspReference": "8800000000000001", "resultCode": "Authorised"}, {})
        )
        if isinstance(body, str):
            return web.Response(status=status, text=body, headers=headers)
        return web.json_response(body, status=status, headers=headers)


@pytest.fixture
async def stand_in() -> AsyncIterator[StandIn]:
    port = free_port()
    standing = StandIn(f"http://127.0.0.1:{port}")
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", standing.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield standing
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("status", "body", "verdict"),
    [
        (429, {"status": 429, "errorCode": "000", "message": "Too many requests"}, "not_executed"),
        (500, {"status": 500, "errorCode": "000", "errorType": "internal"}, "unknown"),
        (502, "<html>Bad Gateway</html>", "unknown"),
        (503, {"status": 503, "errorCode": "000"}, "unknown"),
        (400, {"status": 400, "errorCode": "702", "errorType": "validation"}, "failed"),
        (400, "<html>Bad Request</html>", "unknown"),
        (422, {"message": "no errorCode"}, "unknown"),
        (418, {"status": 418, "errorCode": "000"}, "unknown"),
        (200, "not json", "unknown"),
    ],
)
async def test_each_error_shape_over_http(
    stand_in: StandIn, status: int, body: Any, verdict: str
) -> None:
    headers = {"Retry-After": "3"} if status == 429 else {}
    stand_in.answers.append((status, body, headers))
    answer = await send(provider_at(stand_in.base), payment())
    assert classify(answer).verdict is Verdict(verdict), answer.mapped
    if status == 429:
        assert answer.retry_after == ("3",)  # honoured by the shared code


# -- what is sent, against Adyen's own description --------------------------------------------


@pytest.fixture(scope="module")
def checkout_api() -> OpenAPI:
    return OpenAPI.from_dict(json.loads(DESCRIPTION.read_text()))


def validated(api: OpenAPI, seen: Seen) -> dict[str, Any]:
    """The request as Adyen's v71 description reads it: operation, security
    scheme, Idempotency-Key parameter, and body schema."""
    request = MockRequest(
        ADYEN_HOST,
        seen.method.lower(),
        seen.path,
        headers=seen.headers,
        data=seen.body,
        content_type=seen.headers["Content-Type"].split(";")[0],
    )
    api.validate_request(request)
    body: dict[str, Any] = json.loads(seen.body)
    return body


async def test_a_payment_as_sent_is_valid_v71(stand_in: StandIn, checkout_api: OpenAPI) -> None:
    request = payment(amount=1250)
    await send(provider_at(stand_in.base), request)
    (seen,) = stand_in.seen
    assert (seen.method, seen.path) == ("POST", "/v71/payments")
    assert seen.headers["X-API-Key"] == FAKE_API_KEY
    assert seen.headers["Idempotency-Key"] == request.idempotency_key
    assert validated(checkout_api, seen) == {
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": request.reference,
        "amount": {"value": 1250, "currency": "EUR"},
        "paymentMethod": {"type": "scheme", "storedPaymentMethodId": "8415995487234100"},
        "shopperReference": "shopper_0001",
        "returnUrl": RETURN_URL,
        "shopperInteraction": "Ecommerce",
        "recurringProcessingModel": "CardOnFile",
    }


async def test_a_payment_under_a_mandate_is_merchant_initiated(
    stand_in: StandIn, checkout_api: OpenAPI
) -> None:
    await send(provider_at(stand_in.base), payment(under_mandate=True))
    sent = validated(checkout_api, stand_in.seen[0])
    assert sent["shopperInteraction"] == "ContAuth"
    assert sent["recurringProcessingModel"] == "UnscheduledCardOnFile"
    assert sent["shopperReference"] == "shopper_0001"
    assert sent["paymentMethod"]["storedPaymentMethodId"] == "8415995487234100"


async def test_a_shopper_reference_may_hold_a_colon(stand_in: StandIn) -> None:
    await send(provider_at(stand_in.base), payment(method="shop:42:8415995487234100"))
    sent = json.loads(stand_in.seen[0].body)
    assert sent["shopperReference"] == "shop:42"
    assert sent["paymentMethod"]["storedPaymentMethodId"] == "8415995487234100"


async def test_a_refund_as_sent_is_valid_v71(stand_in: StandIn, checkout_api: OpenAPI) -> None:
    stand_in.answers.append(
        (
            201,
            {
                "merchantAccount": FAKE_MERCHANT_ACCOUNT,
                "paymentPspReference": "8800000000000001",
                "pspReference": "8800000000000002",
                "status": "received",
                "amount": {"value": 400, "currency": "EUR"},
            },
            {},
        )
    )
    request = refund("8800000000000001", amount=400)
    answer = await send(provider_at(stand_in.base), request)
    (seen,) = stand_in.seen
    assert seen.path == "/v71/payments/8800000000000001/refunds"
    assert seen.headers["Idempotency-Key"] == request.idempotency_key
    assert validated(checkout_api, seen) == {
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": request.reference,
        "amount": {"value": 400, "currency": "EUR"},
    }
    assert (answer.provider_reference, classify(answer).verdict) == (
        "8800000000000002",
        Verdict.PENDING,
    )


# -- transport, classified by the shared code ---------------------------------------------------


async def test_a_refused_connection_was_never_sent() -> None:
    answer = await send(provider_at(f"http://127.0.0.1:{free_port()}"), payment())
    assert answer.transport is Transport.NOT_SENT
    assert classify(answer).verdict is Verdict.NOT_EXECUTED


async def test_an_answer_lost_after_the_request_is_unknown() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # the request arrived: it may have been processed
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        answer = await send(provider_at(f"http://127.0.0.1:{port}"), payment())
    finally:
        server.close()
        await server.wait_closed()
    assert answer.transport is Transport.NO_RESPONSE
    assert classify(answer).verdict is Verdict.UNKNOWN


# -- the plug-in ----------------------------------------------------------------------------------


async def test_there_is_no_lookup_and_the_plugin_says_so() -> None:
    config = provider_config(Settings(provider="adyen"))
    consistency = PLUGIN.consistency(config)
    assert consistency.available is False
    assert PLUGIN.kinds == {"payment", "refund"}
    assert PLUGIN.retention(config) is REGISTRY["adyen"]
    provider = provider_at("http://127.0.0.1:9")
    try:
        with pytest.raises(NoLookup, match="no lookup"):
            await provider.lookup(ProviderLookup("payment", "op_1"))
    finally:
        await provider.aclose()


def _problems(**settings: Any) -> list[str]:
    return PLUGIN.problems(provider_config(Settings(provider="adyen", **settings)))


def test_the_plugin_names_what_is_missing() -> None:
    assert _problems() == [
        "INTENTLEDGER_ADYEN_API_KEY is required",
        "INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT is required",
    ]
    complete = {"adyen_api_key": SecretStr("AQE_k+/=;}%"), "adyen_merchant_account": "ShopECOM"}
    assert _problems(**complete) == []
    assert _problems(**complete | {"adyen_merchant_account": " "}) == [
        "INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT is required"
    ]
    (versioned,) = _problems(**complete | {"adyen_api_base": "https://checkout-test.adyen.com/v71"})
    assert "must not name the API version" in versioned


@pytest.mark.parametrize("key", ["AQE_from_a_file\n", " AQE_spaced", "AQE_tab\tbed"])
def test_a_key_that_cannot_be_sent_is_refused_without_being_echoed(key: str) -> None:
    (problem,) = _problems(adyen_api_key=SecretStr(key), adyen_merchant_account="ShopECOM")
    assert "trailing newline" in problem and key.strip() not in problem


def test_what_is_stored_of_an_answer_holds_no_key() -> None:
    key = "AQE_SECRET_key"
    answer = ProviderAnswer(
        Transport.NO_RESPONSE,
        error_class="aiohttp.ClientOSError",
        detail={"error": f"Illegal header value b'{key}\\n'", "body": {"echo": [key]}},
    )
    kept = recordable(answer, key)
    assert key not in str(kept.detail) and "[redacted]" in str(kept.detail["error"])
    assert key in str(answer.detail)  # the original is not changed


# -- serve --provider adyen, on each database ----------------------------------------------------

SERVE_KEY = FAKE_API_KEY


@dataclass
class Ledger:
    url: str
    auth: dict[str, str]
    proc: Process
    fake: AdyenFake

    def post(self, path: str, body: dict[str, Any]) -> str:
        headers = {**self.auth, "Idempotency-Key": f"k-{time.monotonic_ns()}"}
        response = httpx.post(f"{self.url}{path}", json=body, headers=headers)
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def operation(self, op_id: str) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(
            f"{self.url}/v1/operations/{op_id}", headers=self.auth
        ).json()
        return body

    def events(self, op_id: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/v1/operations/{op_id}/events", headers=self.auth)
        data: list[dict[str, Any]] = response.json()["data"]
        return data

    def answered(self, op_id: str, timeout: float = 30) -> dict[str, Any]:
        """The operation once its first answer is recorded."""
        deadline = time.monotonic() + timeout
        while True:
            results = [
                e
                for e in self.events(op_id)
                if e["type"] == "observation" and e["kind"] == "submit_result"
            ]
            if results and self.operation(op_id)["state"] not in ("ACCEPTED", "SUBMITTING"):
                return {**self.operation(op_id), "answer": results[0]}
            assert time.monotonic() < deadline, self.events(op_id)
            time.sleep(0.1)


@pytest.fixture(scope="module", params=BACKENDS)
def ledger(
    request: pytest.FixtureRequest,
    databases: Databases,
    adyen_fake: AdyenFake,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Ledger]:
    database_url = databases.create(str(request.param))
    port = free_port()
    proc = Process(
        [
            "serve",
            *("--port", str(port), "--database-url", database_url, "--provider", "adyen"),
            *("--adyen-api-base", host(adyen_fake)),
            *("--adyen-merchant-account", FAKE_MERCHANT_ACCOUNT),
            *("--submit-timeout", "1500ms", "--sync-timeout", "1500ms"),
            # No check falls due while a test runs: reconciliation is not this module's.
            *("--recheck-backoff", "1h", "--poll-interval", "50ms"),
        ],
        {"INTENTLEDGER_ADYEN_API_KEY": SERVE_KEY},
        tmp_path_factory.mktemp("adyen") / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_healthy(url + "/healthz")
        auth = {"Authorization": f"Bearer {create_key(database_url, 'ada')}"}
        yield Ledger(url, auth, proc, adyen_fake)
    finally:
        proc.stop()


@pytest.fixture
def fresh(ledger: Ledger) -> Ledger:
    ledger.fake.reset()
    return ledger


def test_served_payments_and_a_refund_keep_no_key(fresh: Ledger) -> None:
    paid = fresh.post(
        "/v1/payments", {"amount": 1000, "currency": "EUR", "payment_method": STORED_CARD}
    )
    op = fresh.answered(paid)
    assert (op["state"], op["outcome"]) == ("OUTCOME_KNOWN", "succeeded")
    (executed,) = fresh.fake.truth()["payments"]
    assert executed["reference"] == paid and op["provider_reference"] == executed["pspReference"]
    assert executed["idempotencyKey"] == f"{paid}:1"

    fresh.fake.configure(result_codes=["Refused"])
    refused = fresh.post(
        "/v1/payments", {"amount": 700, "currency": "EUR", "payment_method": STORED_CARD}
    )
    op = fresh.answered(refused)
    assert (op["state"], op["outcome"]) == ("OUTCOME_KNOWN", "failed")

    refunded = fresh.post(f"/v1/payments/{paid}/refunds", {"amount": 400})
    op = fresh.answered(refunded)
    assert op["answer"]["verdict"] == "pending" and op["state"] == "UNKNOWN"
    (sent,) = fresh.fake.truth()["refunds"]
    assert sent["reference"] == refunded
    assert sent["amount"] == {"value": 400, "currency": "EUR"}

    for op_id in (paid, refused, refunded):
        assert SERVE_KEY not in json.dumps(fresh.events(op_id))
    assert SERVE_KEY not in fresh.proc.output()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_key_goes_to_a_person_and_is_not_echoed(
    databases: Databases,
    adyen_fake: AdyenFake,  # noqa: F811
    tmp_path: Path,
    backend: str,
) -> None:
    adyen_fake.reset()
    database_url = databases.create(backend)
    port = free_port()
    wrong = "AQE_wrong_key_for_this_account"
    proc = Process(
        [
            "serve",
            *("--port", str(port), "--database-url", database_url, "--provider", "adyen"),
            *("--adyen-api-base", host(adyen_fake)),
            *("--adyen-merchant-account", FAKE_MERCHANT_ACCOUNT, "--poll-interval", "50ms"),
        ],
        {"INTENTLEDGER_ADYEN_API_KEY": wrong},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_healthy(url + "/healthz")
        served = Ledger(
            url, {"Authorization": f"Bearer {create_key(database_url, 'al')}"}, proc, adyen_fake
        )
        op_id = served.post(
            "/v1/payments", {"amount": 1000, "currency": "EUR", "payment_method": STORED_CARD}
        )
        op = served.answered(op_id)
        assert op["state"] == "MANUAL_REVIEW" and op["answer"]["verdict"] == "misconfigured"
        assert wrong not in json.dumps(served.events(op_id))
    finally:
        proc.stop()
    assert wrong not in proc.output()
    assert adyen_fake.truth()["payments"] == []
