"""The Adyen fake (tests/adyen_fake.py) behaves as Adyen's documentation says,
and speaks the shapes of Adyen's published OpenAPI description.

Every request a test here sends and every answer the fake gives is validated by
openapi-core against tests/adyen_openapi/CheckoutService-v71.json (Adyen's, MIT,
vendored from Adyen/adyen-openapi): the operation found by method and path, its
security scheme and parameters, the request body against PaymentRequest or
PaymentRefundRequest, and the answer's body against the schema documented for
its status (PaymentResponse, PaymentRefundResponse, ServiceError). openapi-core
rather than jsonschema on the component schemas: it reads the document as an
OpenAPI 3.1 description (paths, statuses, headers, `$ref`s across it), so an
answer with a status or a content type the description does not document fails
too, not only a wrong body.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from Adyen import util as adyen_util  # type: ignore[import-untyped]
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest, MockResponse

from intentledger.domain.adyen_signatures import verify_adyen_signature
from tests.adyen_fake import (
    ACCEPTED,
    FAKE_HMAC_KEY,
    FAKE_MERCHANT_ACCOUNT,
    RESULT_CODES,
    AdyenFake,
    adyen_fake,  # noqa: F401
    fresh_adyen,  # noqa: F401
)

DESCRIPTION = Path(__file__).parent / "adyen_openapi" / "CheckoutService-v71.json"
# The description's server, against which its paths are matched.
ADYEN_HOST = "https://checkout-test.adyen.com"
WEEK = 7 * 24 * 3600


@pytest.fixture(scope="module")
def checkout_api() -> OpenAPI:
    return OpenAPI.from_dict(json.loads(DESCRIPTION.read_text()))


class Receiver:
    """Our side of the notifications: records each batch, answers `[accepted]`
    (or, told so, a 500 or a 200 with another body)."""

    def __init__(self) -> None:
        self.mode = "accept"
        self.batches: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.batches.append(json.loads(body))
                    mode = receiver.mode
                status, text = {
                    "accept": (200, ACCEPTED),
                    "fail": (500, "down"),
                    "wrong_body": (200, "ok"),
                }[mode]
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/provider-webhooks/adyen"

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                entry["NotificationRequestItem"]
                for batch in self.batches
                for entry in batch["notificationItems"]
            ]

    def wait_for(self, count: int, timeout: float = 10) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.items()) < count:
            assert time.monotonic() < deadline, f"{len(self.items())} of {count} items came"
            time.sleep(0.02)
        return self.items()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiving = Receiver()
    yield receiving
    receiving.close()


@pytest.fixture
def adyen(fresh_adyen: AdyenFake, receiver: Receiver) -> AdyenFake:  # noqa: F811
    fresh_adyen.configure(notify_url=receiver.url)
    return fresh_adyen


Call = Callable[..., httpx.Response]


@pytest.fixture
def call(adyen: AdyenFake, checkout_api: OpenAPI) -> Call:
    """POST to the fake; the request and the answer validated against Adyen's description."""

    def post(
        path: str,
        body: dict[str, Any],
        key: str | None = None,
        headers: dict[str, str] | None = None,
        documented: bool = True,
    ) -> httpx.Response:
        sent_headers = headers if headers is not None else adyen.headers(key)
        raw = json.dumps(body).encode()
        request = MockRequest(
            ADYEN_HOST,
            "post",
            f"/v71{path}",
            headers=sent_headers,
            data=raw,
            content_type="application/json",
        )
        if "X-API-Key" in sent_headers:
            checkout_api.validate_request(request)
        response = httpx.post(
            f"{adyen.api_base}{path}", content=raw, headers=sent_headers, timeout=15
        )
        answer = MockResponse(
            response.content,
            status_code=response.status_code,
            headers=dict(response.headers),
            content_type=response.headers["content-type"].split(";")[0],
        )
        if documented:
            checkout_api.validate_response(request, answer)
        return response

    return post


def payment(reference: str, holder: str = "J. Smith", value: int = 1000) -> dict[str, Any]:
    return {
        "amount": {"value": value, "currency": "EUR"},
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": reference,
        "returnUrl": "https://merchant.example/return",
        "paymentMethod": {
            "type": "scheme",
            "encryptedCardNumber": "test_4111111111111111",
            "encryptedExpiryMonth": "test_03",
            "encryptedExpiryYear": "test_2030",
            "encryptedSecurityCode": "test_737",
            "holderName": holder,
        },
    }


def mandate_payment(reference: str) -> dict[str, Any]:
    """A stored card charged by the merchant, as issue 37's adapter sends mandates."""
    return {
        "amount": {"value": 2500, "currency": "EUR"},
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": reference,
        "returnUrl": "https://merchant.example/return",
        "paymentMethod": {"type": "scheme", "storedPaymentMethodId": "8415995487234100"},
        "shopperReference": "shopper_0001",
        "recurringProcessingModel": "UnscheduledCardOnFile",
        "shopperInteraction": "ContAuth",
    }


def refund(reference: str, value: int = 400) -> dict[str, Any]:
    return {
        "amount": {"value": value, "currency": "EUR"},
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": reference,
    }


def assert_signed(item: dict[str, Any]) -> None:
    """Signed as Adyen signs: Adyen's library and ours both accept it."""
    assert adyen_util.is_valid_hmac_notification(item, FAKE_HMAC_KEY)
    verify_adyen_signature(item, [FAKE_HMAC_KEY])


# -- idempotency -----------------------------------------------------------------


def test_a_resend_inside_the_retention_replays_the_first_answer(
    adyen: AdyenFake, call: Call
) -> None:
    key = str(uuid.uuid4())
    first = call("/payments", payment("op_1"), key)
    assert first.status_code == 200
    assert first.headers["Idempotency-Key"] == key
    adyen.advance_clock(WEEK - 60)
    again = call("/payments", payment("op_1"), key)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert again.headers["Idempotency-Key"] == key
    assert [p["pspReference"] for p in adyen.truth()["payments"]] == [first.json()["pspReference"]]


def test_a_resend_past_the_retention_executes_again(adyen: AdyenFake, call: Call) -> None:
    key = str(uuid.uuid4())
    first = call("/payments", payment("op_1"), key)
    adyen.advance_clock(WEEK + 1)
    again = call("/payments", payment("op_1"), key)
    assert again.status_code == 200
    assert again.json()["pspReference"] != first.json()["pspReference"]
    assert len(adyen.truth()["payments"]) == 2


def test_the_retention_is_configurable(adyen: AdyenFake, call: Call) -> None:
    adyen.configure(retention_seconds=3600)
    key = str(uuid.uuid4())
    call("/payments", payment("op_1"), key)
    adyen.advance_clock(3601)
    call("/payments", payment("op_1"), key)
    assert len(adyen.truth()["payments"]) == 2


def test_a_key_reused_with_another_body_is_refused(adyen: AdyenFake, call: Call) -> None:
    key = str(uuid.uuid4())
    call("/payments", payment("op_1"), key)
    other = call("/payments", payment("op_1", value=999), key)
    assert other.status_code == 422
    assert other.json()["errorCode"] == "704"
    assert len(adyen.truth()["payments"]) == 1


@pytest.mark.parametrize("status", [422, 409])
def test_a_resend_while_the_first_runs_meets_the_in_progress_answer(
    adyen: AdyenFake, call: Call, status: int
) -> None:
    adyen.configure(execution_seconds=1.0, in_progress_status=status)
    key = str(uuid.uuid4())
    answers: list[httpx.Response] = []
    first = threading.Thread(target=lambda: answers.append(call("/payments", payment("o"), key)))
    first.start()
    time.sleep(0.3)
    # 409 is not in the description's answers for /payments: not validated.
    during = call("/payments", payment("o"), key, documented=status == 422)
    first.join()
    assert during.status_code == status
    assert during.json()["errorCode"] == "704"
    assert answers[0].status_code == 200
    assert len(adyen.truth()["payments"]) == 1


def test_a_wrong_api_key_is_refused_before_anything_runs(adyen: AdyenFake, call: Call) -> None:
    answer = call(
        "/payments",
        payment("op_1"),
        headers={"X-API-Key": "wrong", "Content-Type": "application/json"},
    )
    assert answer.status_code == 401
    assert answer.json()["errorType"] == "security"
    assert adyen.truth()["payments"] == []


# -- result codes ------------------------------------------------------------------


@pytest.mark.parametrize("code", RESULT_CODES)
def test_each_result_code_by_the_holder_name_or_the_queue(
    adyen: AdyenFake, call: Call, code: str
) -> None:
    by_name = call("/payments", payment("op_name", holder=code.upper()), str(uuid.uuid4()))
    assert by_name.json()["resultCode"] == code
    adyen.configure(result_codes=[code])
    queued = call("/payments", payment("op_queue"), str(uuid.uuid4()))
    assert queued.json()["resultCode"] == code
    truth = adyen.truth()["payments"]
    assert [p["resultCode"] for p in truth] == [code, code]


def test_an_unnamed_result_code_is_outside_the_description(
    adyen: AdyenFake, call: Call, checkout_api: OpenAPI
) -> None:
    adyen.configure(result_codes=["SomethingNew"])
    answer = call("/payments", payment("op_1"), str(uuid.uuid4()), documented=False)
    assert answer.json() == {
        "pspReference": answer.json()["pspReference"],
        "resultCode": "SomethingNew",
    }
    request = MockRequest(ADYEN_HOST, "post", "/v71/payments", content_type="application/json")
    with pytest.raises(Exception, match="'SomethingNew' is not one of"):
        checkout_api.validate_response(
            request, MockResponse(answer.content, status_code=200, content_type="application/json")
        )


def test_a_stored_card_charged_by_the_merchant(adyen: AdyenFake, call: Call) -> None:
    answer = call("/payments", mandate_payment("op_mandate"), str(uuid.uuid4()))
    assert answer.json()["resultCode"] == "Authorised"


# -- notifications -------------------------------------------------------------------


def test_a_final_answer_is_notified_signed(
    adyen: AdyenFake, call: Call, receiver: Receiver
) -> None:
    authorised = call("/payments", payment("op_ok"), str(uuid.uuid4())).json()
    refused = call("/payments", payment("op_no", holder="Refused"), str(uuid.uuid4())).json()
    items = receiver.wait_for(2)
    by_reference = {item["merchantReference"]: item for item in items}
    assert by_reference["op_ok"]["pspReference"] == authorised["pspReference"]
    assert by_reference["op_ok"]["success"] == "true"
    assert by_reference["op_no"]["pspReference"] == refused["pspReference"]
    assert by_reference["op_no"]["success"] == "false"
    for item in items:
        assert item["eventCode"] == "AUTHORISATION"
        assert item["merchantAccountCode"] == FAKE_MERCHANT_ACCOUNT
        assert_signed(item)
    assert all(batch["live"] == "false" for batch in receiver.batches)
    assert all(d["accepted"] for d in adyen.truth()["deliveries"])


def test_a_pending_payment_is_settled_by_a_later_notification(
    adyen: AdyenFake, call: Call, receiver: Receiver
) -> None:
    adyen.configure(result_codes=["Pending"])
    pending = call("/payments", payment("op_pending"), str(uuid.uuid4())).json()
    assert pending["resultCode"] == "Pending"
    time.sleep(0.3)
    assert receiver.items() == []
    adyen.settle(pending["pspReference"], success=True)
    (item,) = receiver.wait_for(1)
    assert (item["pspReference"], item["eventCode"], item["success"]) == (
        pending["pspReference"],
        "AUTHORISATION",
        "true",
    )
    assert_signed(item)
    assert adyen.truth()["payments"][0]["settled"] is True


@pytest.mark.parametrize(
    ("outcome", "event_code", "success"),
    [
        ("REFUND", "REFUND", "true"),
        ("REFUND:false", "REFUND", "false"),
        ("REFUND_FAILED", "REFUND_FAILED", "true"),
    ],
)
def test_a_refund_is_received_then_notified(
    adyen: AdyenFake,
    call: Call,
    receiver: Receiver,
    outcome: str,
    event_code: str,
    success: str,
) -> None:
    paid = call("/payments", payment("op_pay"), str(uuid.uuid4())).json()
    receiver.wait_for(1)
    adyen.configure(refund_outcomes=[outcome])
    key = str(uuid.uuid4())
    answer = call(f"/payments/{paid['pspReference']}/refunds", refund("op_refund"), key)
    assert answer.status_code == 201
    received = answer.json()
    assert received["status"] == "received"
    assert received["paymentPspReference"] == paid["pspReference"]
    item = receiver.wait_for(2)[1]
    assert item["eventCode"] == event_code
    assert item["success"] == success
    assert item["pspReference"] == received["pspReference"]
    assert item["originalReference"] == paid["pspReference"]
    assert item["merchantReference"] == "op_refund"
    assert_signed(item)
    # The refund's key replays like the payment's.
    again = call(f"/payments/{paid['pspReference']}/refunds", refund("op_refund"), key)
    assert again.json() == received
    assert len(adyen.truth()["refunds"]) == 1


def test_a_refund_held_back_is_settled_on_demand(
    adyen: AdyenFake, call: Call, receiver: Receiver
) -> None:
    paid = call("/payments", payment("op_pay"), str(uuid.uuid4())).json()
    receiver.wait_for(1)
    adyen.configure(refund_outcomes=["none"])
    received = call(
        f"/payments/{paid['pspReference']}/refunds", refund("op_refund"), str(uuid.uuid4())
    ).json()
    time.sleep(0.3)
    assert len(receiver.items()) == 1
    adyen.settle(received["pspReference"], outcome="REFUND_FAILED")
    assert receiver.wait_for(2)[1]["eventCode"] == "REFUND_FAILED"


def test_a_refund_of_an_unknown_payment_is_refused(adyen: AdyenFake, call: Call) -> None:
    answer = call("/payments/8800000000000000/refunds", refund("op_refund"), str(uuid.uuid4()))
    assert answer.status_code == 422
    assert adyen.truth()["refunds"] == []


def test_notifications_held_come_late_twice_and_out_of_order(
    adyen: AdyenFake, call: Call, receiver: Receiver
) -> None:
    adyen.configure(hold_notifications=True)
    references = [
        call("/payments", payment(f"op_{n}"), str(uuid.uuid4())).json()["pspReference"]
        for n in range(3)
    ]
    time.sleep(0.3)
    assert receiver.items() == []
    assert len(adyen.truth()["held"]) == 3
    assert adyen.flush_notifications(order="reverse", duplicate=True) == 6
    items = receiver.wait_for(6)
    assert [item["pspReference"] for item in items] == [
        psp for psp in reversed(references) for _ in range(2)
    ]
    for item in items:
        assert_signed(item)


def test_a_batch_of_several_items(adyen: AdyenFake, call: Call, receiver: Receiver) -> None:
    adyen.configure(hold_notifications=True)
    for n in range(3):
        call("/payments", payment(f"op_{n}"), str(uuid.uuid4()))
    adyen.flush_notifications(order="shuffle", seed=7, batch=True)
    receiver.wait_for(3)
    assert len(receiver.batches) == 1
    # Adyen's library reads only the first item of a batch; each is signed alone.
    for item in receiver.items():
        assert_signed(item)


def test_a_delayed_and_duplicated_notification(
    adyen: AdyenFake, call: Call, receiver: Receiver
) -> None:
    adyen.configure(notification_delay_seconds=1.0, duplicate_notifications=True)
    call("/payments", payment("op_late"), str(uuid.uuid4()))
    time.sleep(0.4)
    assert receiver.items() == []
    first, second = receiver.wait_for(2)
    assert first == second


@pytest.mark.parametrize("mode", ["fail", "wrong_body"])
def test_an_unacknowledged_notification_is_sent_again(
    adyen: AdyenFake, call: Call, receiver: Receiver, mode: str
) -> None:
    adyen.configure(notification_retry_seconds=0.2)
    receiver.mode = mode
    call("/payments", payment("op_retry"), str(uuid.uuid4()))
    receiver.wait_for(1)
    receiver.mode = "accept"
    receiver.wait_for(2)
    deadline = time.monotonic() + 5
    while not any(d.get("accepted") for d in adyen.truth()["deliveries"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    accepted = [d["accepted"] for d in adyen.truth()["deliveries"]]
    assert accepted[0] is False
    assert accepted[-1] is True
