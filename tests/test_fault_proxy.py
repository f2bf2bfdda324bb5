"""The suite's fault proxy (intentledger.testing.fault_proxy) in front of the Adyen fake:
faults after forwarding execute at the fake and lose the answer, a same-key
resend then meets the fake's replay; faults before forwarding execute nothing.
Its error answers are Adyen's, as the published description documents them.
(The proxy in front of localstripe is tested in tests/test_stripe_fake.py.)"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_core import OpenAPI
from openapi_core.testing import MockRequest, MockResponse

from tests.adyen_fake import FAKE_API_KEY, FAKE_MERCHANT_ACCOUNT, AdyenFake
from tests.fault_proxy import FaultProxyProcess

DESCRIPTION = Path(__file__).parent / "adyen_openapi" / "CheckoutService-v71.json"


@pytest.fixture(scope="module")
def behind_proxy(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[AdyenFake, FaultProxyProcess]]:
    with AdyenFake() as fake:
        upstream = f"http://127.0.0.1:{fake.public_port}"
        workdir = tmp_path_factory.mktemp("adyen-proxy")
        with FaultProxyProcess("tests.adyen_fake", upstream, workdir) as proxy:
            yield fake, proxy


@pytest.fixture
def fake(behind_proxy: tuple[AdyenFake, FaultProxyProcess]) -> AdyenFake:
    behind_proxy[0].reset()
    return behind_proxy[0]


@pytest.fixture
def proxy(behind_proxy: tuple[AdyenFake, FaultProxyProcess]) -> FaultProxyProcess:
    behind_proxy[1].reset()
    return behind_proxy[1]


def payment(reference: str) -> dict[str, Any]:
    return {
        "amount": {"value": 1000, "currency": "EUR"},
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": reference,
        "returnUrl": "https://merchant.example/return",
        "paymentMethod": {"type": "scheme", "storedPaymentMethodId": "8415995487234100"},
        "shopperReference": "shopper_0001",
        "recurringProcessingModel": "UnscheduledCardOnFile",
        "shopperInteraction": "ContAuth",
    }


def post(
    proxy: FaultProxyProcess, path: str, body: dict[str, Any], key: str, timeout: float = 10
) -> httpx.Response:
    headers = {"X-API-Key": FAKE_API_KEY, "Idempotency-Key": key}
    return httpx.post(f"{proxy.base}/v71{path}", json=body, headers=headers, timeout=timeout)


def test_error_after_executes_and_a_same_key_resend_meets_the_fake_s_replay(
    fake: AdyenFake, proxy: FaultProxyProcess
) -> None:
    proxy.configure(queue=["error_after"])
    key = str(uuid.uuid4())
    lost = post(proxy, "/payments", payment("op_1"), key)
    assert lost.status_code == 500
    error = lost.json()
    assert (error["status"], error["errorType"]) == (500, "internal")
    # A ServiceError, as Adyen's description documents the 500.
    request = MockRequest(
        "https://checkout-test.adyen.com",
        "post",
        "/v71/payments",
        headers={"X-API-Key": FAKE_API_KEY, "Idempotency-Key": key},
        data=json.dumps(payment("op_1")).encode(),
        content_type="application/json",
    )
    answer = MockResponse(lost.content, status_code=500, content_type="application/json")
    OpenAPI.from_dict(json.loads(DESCRIPTION.read_text())).validate_response(request, answer)
    executed = fake.truth()["payments"]
    assert [p["reference"] for p in executed] == ["op_1"]

    again = post(proxy, "/payments", payment("op_1"), key)
    assert again.status_code == 200
    assert again.json()["pspReference"] == executed[0]["pspReference"]
    # The fake's headers come through the proxy.
    assert again.headers["Idempotency-Key"] == key
    assert again.headers["pspReference"] == executed[0]["pspReference"]
    assert len(fake.truth()["payments"]) == 1
    assert [e["fault"] for e in proxy.log()] == ["error_after", "none"]


def test_reset_after_and_hold_after_execute_and_lose_the_answer(
    fake: AdyenFake, proxy: FaultProxyProcess
) -> None:
    proxy.configure(queue=["reset_after", "hold_after"], hold_seconds=2)
    with pytest.raises(httpx.TransportError):
        post(proxy, "/payments", payment("op_1"), str(uuid.uuid4()))
    with pytest.raises(httpx.ReadTimeout):
        post(proxy, "/payments", payment("op_2"), str(uuid.uuid4()), timeout=0.5)
    assert [p["reference"] for p in fake.truth()["payments"]] == ["op_1", "op_2"]


def test_faults_before_forwarding_execute_nothing(
    fake: AdyenFake, proxy: FaultProxyProcess
) -> None:
    proxy.configure(queue=["rate_limited", "error_before", "refuse"], retry_after=2)
    limited = post(proxy, "/payments", payment("op_1"), str(uuid.uuid4()))
    assert limited.status_code == 429
    assert limited.headers["Retry-After"] == "2"
    assert {"status", "errorCode", "message", "errorType"} <= set(limited.json())
    assert post(proxy, "/payments", payment("op_1"), str(uuid.uuid4())).status_code == 500
    with pytest.raises(httpx.TransportError):
        post(proxy, "/payments", payment("op_1"), str(uuid.uuid4()))
    assert fake.truth()["payments"] == []


def test_refunds_are_faulted_too(fake: AdyenFake, proxy: FaultProxyProcess) -> None:
    paid = post(proxy, "/payments", payment("op_1"), str(uuid.uuid4())).json()
    proxy.configure(queue=["error_before"])
    refund = {
        "amount": {"value": 400, "currency": "EUR"},
        "merchantAccount": FAKE_MERCHANT_ACCOUNT,
        "reference": "op_r1",
    }
    refused = post(proxy, f"/payments/{paid['pspReference']}/refunds", refund, str(uuid.uuid4()))
    assert refused.status_code == 500
    assert fake.truth()["refunds"] == []
    assert [e["fault"] for e in proxy.log()] == ["none", "error_before"]
