"""intentledger against Adyen's shape, end to end: `serve --provider adyen` over
real HTTP to the Adyen-shaped fake (tests/adyen_fake.py), whose signed
notifications the fake posts to the ledger's /v1/provider-webhooks/adyen.
Adyen has no lookup: a lost answer is recovered by a same-key resend while the
key is inside Adyen's documented retention (less the margin), and past it a
person decides; notifications settle what answers leave open. The ledger's
word is checked against the fake's own truth, never against the ledger.

The scenario table of issue 37, on both databases:

    Authorised, Refused                       settled by the answer
    lost answer, key inside the retention     same-key resend (a decision row), one execution
    lost answer, key past the retention       a person, never a new key; notifications settle
    Pending                                   settled by the late notification
    refund `received`                         succeeded / failed by notification
    a notification before the answer          settles; the answer is late evidence
    duplicated notifications                  one effect
    contradicting notifications               the contradiction is flagged
    a chargeback                              recorded on the payment, flagged for a person
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from intentledger.domain.adyen_signatures import signed_adyen_item
from intentledger.ports import free_port
from tests.adyen_fake import (
    FAKE_API_KEY,
    FAKE_HMAC_KEY,
    FAKE_MERCHANT_ACCOUNT,
    AdyenFake,
    adyen_fake,  # noqa: F401
)
from tests.conftest import BACKENDS, Databases
from tests.support import Process, wait_until
from tests.test_intake_http import create_key

# A lost answer: the fake executes for longer than the ledger waits.
SUBMIT_TIMEOUT = "1s"
SLOW_EXECUTION = 2.5
SETTLED = {"OUTCOME_KNOWN"}
# A card Adyen stored for one of the merchant's shoppers (docs/providers.md).
STORED_CARD = "shopper-17:8415718415172204"


@dataclass
class AdyenLedger:
    url: str
    database_url: str
    auth: dict[str, str]
    adyen: AdyenFake

    def pay(self, amount: int = 1000) -> str:
        body = {"amount": amount, "currency": "EUR", "payment_method": STORED_CARD}
        key = f"pay-{time.monotonic_ns()}"
        response = httpx.post(
            f"{self.url}/v1/payments", json=body, headers={**self.auth, "Idempotency-Key": key}
        )
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def refund(self, payment_id: str, amount: int = 400) -> str:
        response = httpx.post(
            f"{self.url}/v1/payments/{payment_id}/refunds",
            json={"amount": amount},
            headers={**self.auth, "Idempotency-Key": f"refund-{time.monotonic_ns()}"},
        )
        assert response.status_code == 202, response.text
        return str(response.json()["id"])

    def operation(self, op_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/operations/{op_id}", headers=self.auth)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def events(self, op_id: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/v1/operations/{op_id}/events", headers=self.auth)
        data: list[dict[str, Any]] = response.json()["data"]
        return data

    def observations(self, op_id: str, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events(op_id) if e["type"] == "observation" and e["kind"] == kind]

    def seen(self, op_id: str, kind: str, timeout: float = 10) -> None:
        """Wait until `op_id` has an observation of `kind`."""
        wait_until(lambda: bool(self.observations(op_id, kind)), timeout, f"a {kind} of {op_id}")

    def rules(self, op_id: str) -> list[str]:
        return [e["rule"] for e in self.events(op_id) if e["type"] == "decision"]

    def settle(self, op_id: str, states: set[str], timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (op := self.operation(op_id))["state"] not in states:
            assert time.monotonic() < deadline, f"{op_id} is {op['state']}: {self.events(op_id)}"
            time.sleep(0.1)
        return op

    def payments_at_adyen(self, op_id: str) -> list[dict[str, Any]]:
        """Every payment the fake executed under our reference: its truth."""
        payments = self.adyen.truth()["payments"]
        return [p for p in payments if p["reference"] == op_id]

    def refunds_at_adyen(self, op_id: str) -> list[dict[str, Any]]:
        refunds = self.adyen.truth()["refunds"]
        return [r for r in refunds if r["reference"] == op_id]

    def requests_for(self, op_id: str) -> list[dict[str, Any]]:
        """Every request the fake received whose idempotency key is one of `op_id`'s."""
        return [
            r
            for r in self.adyen.truth()["requests"]
            if str(r.get("idempotency_key") or "").startswith(f"{op_id}:")
        ]

    def notify(self, *items: dict[str, Any]) -> httpx.Response:
        """A notification batch, signed as Adyen signs it, posted to the ledger."""
        batch = {
            "live": "false",
            "notificationItems": [
                {"NotificationRequestItem": signed_adyen_item(item, FAKE_HMAC_KEY)}
                for item in items
            ],
        }
        return self.post_notifications(batch)

    def post_notifications(self, batch: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/provider-webhooks/adyen",
            content=json.dumps(batch),
            headers={"Content-Type": "application/json"},
        )


def serve_adyen(
    database_url: str, workdir: Path, adyen: AdyenFake, safety_rules: str | None = None
) -> tuple[Process, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    options = ["--safety-rules", safety_rules] if safety_rules else []
    proc = Process(
        [
            *("serve", "--port", str(port), "--database-url", database_url),
            *("--provider", "adyen", "--submit-timeout", SUBMIT_TIMEOUT),
            *("--sync-timeout", SUBMIT_TIMEOUT, "--recheck-backoff", "1s"),
            *("--poll-interval", "50ms", *options),
        ],
        {
            "INTENTLEDGER_ADYEN_API_KEY": FAKE_API_KEY,
            "INTENTLEDGER_ADYEN_API_BASE": adyen.api_base.removesuffix("/v71"),
            "INTENTLEDGER_ADYEN_MERCHANT_ACCOUNT": FAKE_MERCHANT_ACCOUNT,
            "INTENTLEDGER_ADYEN_HMAC_KEYS": FAKE_HMAC_KEY,
        },
        workdir / "serve.log",
    )
    return proc, url


def _ledger(
    databases: Databases,
    backend: str,
    adyen: AdyenFake,
    workdir: Path,
    safety_rules: str | None = None,
) -> Iterator[AdyenLedger]:
    database_url = databases.create(backend)
    proc, url = serve_adyen(database_url, workdir, adyen, safety_rules)
    try:
        proc.wait_healthy(url + "/healthz")
        auth = {"Authorization": f"Bearer {create_key(database_url, 'ada')}"}
        yield AdyenLedger(url, database_url, auth, adyen)
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def adyen_ledger(
    request: pytest.FixtureRequest,
    databases: Databases,
    adyen_fake: AdyenFake,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AdyenLedger]:
    yield from _ledger(databases, str(request.param), adyen_fake, tmp_path_factory.mktemp("adyen"))


@pytest.fixture
def ledger(adyen_ledger: AdyenLedger) -> AdyenLedger:
    adyen_ledger.adyen.reset()
    adyen_ledger.adyen.configure(notify_url=f"{adyen_ledger.url}/v1/provider-webhooks/adyen")
    return adyen_ledger


def test_authorised_settles_succeeded_with_its_psp_reference(ledger: AdyenLedger) -> None:
    op_id = ledger.pay()
    op = ledger.settle(op_id, SETTLED)
    (payment,) = ledger.payments_at_adyen(op_id)
    assert op["outcome"] == "succeeded" and op["provider_reference"] == payment["pspReference"]
    assert payment["amount"] == {"value": 1000, "currency": "EUR"}
    # Its AUTHORISATION notification arrives too, and agrees.
    ledger.seen(op_id, "provider_event")
    op = ledger.operation(op_id)
    assert not op["outcome_contradicted"] and not op["duplicate_detected"]
    assert FAKE_API_KEY not in str(ledger.events(op_id))


def test_refused_settles_failed(ledger: AdyenLedger) -> None:
    ledger.adyen.configure(result_codes=["Refused"])
    op_id = ledger.pay()
    op = ledger.settle(op_id, SETTLED)
    assert op["outcome"] == "failed"
    # The REFUSED notification may settle the operation before the answer's
    # own record commits (both are evidence): wait for the answer too.
    ledger.seen(op_id, "submit_result")
    (answer,) = ledger.observations(op_id, "submit_result")
    assert answer["verdict"] == "failed"
    ledger.seen(op_id, "provider_event")
    assert not ledger.operation(op_id)["outcome_contradicted"]


def test_a_lost_answer_inside_the_retention_is_recovered_by_a_same_key_resend(
    ledger: AdyenLedger,
) -> None:
    # The notification is held back: what settles it here is the resend.
    ledger.adyen.configure(execution_seconds=SLOW_EXECUTION, hold_notifications=True)
    op_id = ledger.pay()
    op = ledger.settle(op_id, SETTLED, timeout=45)
    (payment,) = ledger.payments_at_adyen(op_id)  # executed once
    assert op["outcome"] == "succeeded" and op["provider_reference"] == payment["pspReference"]
    assert "replay_within_retention" in ledger.rules(op_id)
    sent = ledger.requests_for(op_id)
    assert len(sent) >= 2 and {r["idempotency_key"] for r in sent} == {f"{op_id}:1"}
    assert not [
        o for o in ledger.observations(op_id, "lookup_result") if o["verdict"] != "no_lookup"
    ]
    ledger.adyen.flush_notifications()
    ledger.seen(op_id, "provider_event")
    op = ledger.operation(op_id)
    assert not op["outcome_contradicted"] and not op["duplicate_detected"]


@pytest.fixture(scope="module", params=BACKENDS)
def retention_passed_ledger(
    request: pytest.FixtureRequest,
    databases: Databases,
    adyen_fake: AdyenFake,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[AdyenLedger]:
    """A ledger whose rule stops replays all but the whole retention short of
    Adyen's: every key is past the bound at its first check."""
    workdir = tmp_path_factory.mktemp("adyen-retention")
    rules = workdir / "safety.toml"
    rules.write_text("[provider.adyen]\nmargin = 0.99999999\n")
    yield from _ledger(databases, str(request.param), adyen_fake, workdir, str(rules))


def test_a_lost_answer_past_the_retention_goes_to_a_person_and_no_new_key(
    retention_passed_ledger: AdyenLedger,
) -> None:
    ledger = retention_passed_ledger
    ledger.adyen.reset()
    ledger.adyen.configure(
        notify_url=f"{ledger.url}/v1/provider-webhooks/adyen",
        execution_seconds=SLOW_EXECUTION,
        hold_notifications=True,
    )
    op_id = ledger.pay()
    op = ledger.settle(op_id, {"MANUAL_REVIEW"}, timeout=30)
    assert op["next_action"] == "operator"
    assert "retention_passed" in ledger.rules(op_id)
    time.sleep(SLOW_EXECUTION)  # the first request completes at the fake meanwhile
    sent = ledger.requests_for(op_id)
    assert [r["idempotency_key"] for r in sent] == [f"{op_id}:1"]  # sent once, never again
    # The notification still settles it, and the person has nothing left to decide.
    ledger.adyen.flush_notifications()
    op = ledger.settle(op_id, SETTLED, timeout=15)
    assert op["outcome"] == "succeeded"
    assert len(ledger.payments_at_adyen(op_id)) == 1


def test_a_pending_payment_is_settled_by_its_late_notification(ledger: AdyenLedger) -> None:
    ledger.adyen.configure(result_codes=["Pending"])
    op_id = ledger.pay()
    ledger.seen(op_id, "submit_result")
    assert ledger.operation(op_id)["state"] != "OUTCOME_KNOWN"
    (payment,) = ledger.payments_at_adyen(op_id)
    ledger.adyen.settle(payment["pspReference"], success=True)
    op = ledger.settle(op_id, SETTLED, timeout=15)
    assert op["outcome"] == "succeeded" and op["provider_reference"] == payment["pspReference"]
    (event,) = ledger.observations(op_id, "provider_event")
    assert event["verdict"] == "succeeded"


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [("REFUND", "succeeded"), ("REFUND:false", "failed"), ("REFUND_FAILED", "failed")],
)
def test_a_received_refund_is_settled_by_its_notification(
    ledger: AdyenLedger, outcome: str, expected: str
) -> None:
    payment_id = ledger.pay()
    ledger.settle(payment_id, SETTLED)
    ledger.adyen.configure(refund_outcomes=["none"])  # the fake waits to be told
    refund_id = ledger.refund(payment_id)
    ledger.seen(refund_id, "submit_result")
    (answer,) = ledger.observations(refund_id, "submit_result")
    assert answer["verdict"] == "pending"  # `received` is never success
    assert ledger.operation(refund_id)["state"] != "OUTCOME_KNOWN"
    (refund,) = ledger.refunds_at_adyen(refund_id)
    ledger.adyen.settle(refund["pspReference"], outcome=outcome)
    op = ledger.settle(refund_id, SETTLED, timeout=15)
    assert op["outcome"] == expected


def test_a_notification_before_the_answer_settles_and_the_answer_agrees(
    ledger: AdyenLedger,
) -> None:
    # The answer waits (under the ledger's 1 s timeout) until the notification is taken.
    ledger.adyen.configure(answer_delay_seconds=0.9)
    op_id = ledger.pay()
    op = ledger.settle(op_id, SETTLED)
    ledger.seen(op_id, "submit_result")
    ledger.seen(op_id, "provider_event")
    (event,) = ledger.observations(op_id, "provider_event")
    (answer,) = ledger.observations(op_id, "submit_result")
    assert event["at"] <= answer["at"]
    assert op["outcome"] == "succeeded"
    op = ledger.operation(op_id)
    assert not op["outcome_contradicted"] and not op["duplicate_detected"]


def test_duplicated_notifications_make_one_effect(ledger: AdyenLedger) -> None:
    ledger.adyen.configure(hold_notifications=True, result_codes=["Pending"])
    op_id = ledger.pay()
    ledger.seen(op_id, "submit_result")
    (payment,) = ledger.payments_at_adyen(op_id)
    ledger.adyen.settle(payment["pspReference"], success=True)
    ledger.adyen.flush_notifications(duplicate=True, batch=True)
    op = ledger.settle(op_id, SETTLED, timeout=15)
    ledger.adyen.flush_notifications(duplicate=True)  # nothing held: nothing more
    assert op["outcome"] == "succeeded"
    assert len(ledger.observations(op_id, "provider_event")) == 1


def test_contradicting_notifications_are_flagged(ledger: AdyenLedger) -> None:
    ledger.adyen.configure(hold_notifications=True)
    op_id = ledger.pay()
    ledger.settle(op_id, SETTLED)
    (payment,) = ledger.payments_at_adyen(op_id)
    ledger.adyen.settle(payment["pspReference"], success=False)  # Adyen's success flips
    ledger.adyen.flush_notifications(order="reverse")
    try:
        wait_until(lambda: len(ledger.observations(op_id, "provider_event")) == 2, 10, "both")
    except AssertionError as exc:
        deliveries = [
            {k: v for k, v in d.items() if k != "batch"} for d in ledger.adyen.truth()["deliveries"]
        ]
        raise AssertionError(f"{exc}: {ledger.events(op_id)} {deliveries}") from exc
    assert ledger.operation(op_id)["outcome_contradicted"]
    events = ledger.observations(op_id, "provider_event")
    assert {e["verdict"] for e in events} == {"succeeded", "failed"}


def test_a_chargeback_is_recorded_on_its_payment_and_flagged(ledger: AdyenLedger) -> None:
    op_id = ledger.pay()
    op = ledger.settle(op_id, SETTLED)
    chargeback = {
        "pspReference": op["provider_reference"],
        "merchantAccountCode": FAKE_MERCHANT_ACCOUNT,
        "merchantReference": op_id,
        "amount": {"value": 1000, "currency": "EUR"},
        "eventCode": "CHARGEBACK",
        "success": "true",
        "eventDate": "2026-12-04T10:00:00+01:00",
    }
    response = ledger.notify(chargeback)
    assert response.status_code == 200 and response.text == "[accepted]"
    flagged = [e for e in ledger.observations(op_id, "provider_event") if e["verdict"] == "flagged"]
    assert len(flagged) == 1
    assert ledger.operation(op_id)["outcome"] == "succeeded"  # the ledger changed nothing
    metrics = httpx.get(f"{ledger.url}/metrics").text
    assert 'intentledger_provider_events_flagged_total{provider="adyen"} 1.0' in metrics


def test_a_forged_item_refuses_its_batch_and_stores_nothing(ledger: AdyenLedger) -> None:
    ledger.adyen.configure(hold_notifications=True, result_codes=["Pending"])
    op_id = ledger.pay()
    ledger.seen(op_id, "submit_result")
    (payment,) = ledger.payments_at_adyen(op_id)
    item = {
        "pspReference": payment["pspReference"],
        "merchantAccountCode": FAKE_MERCHANT_ACCOUNT,
        "merchantReference": op_id,
        "amount": {"value": 1000, "currency": "EUR"},
        "eventCode": "AUTHORISATION",
        "success": "true",
        "eventDate": "2026-12-04T10:00:00+01:00",
    }
    forged = signed_adyen_item(item, "00" * 32)
    batch = {"notificationItems": [{"NotificationRequestItem": forged}]}
    response = ledger.post_notifications(batch)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/problem+json")
    assert not ledger.observations(op_id, "provider_event")
    assert ledger.operation(op_id)["state"] != "OUTCOME_KNOWN"


def _item(
    psp: str, reference: str, code: str, success: str, value: int, **extra: Any
) -> dict[str, Any]:
    return {
        "pspReference": psp,
        "merchantAccountCode": FAKE_MERCHANT_ACCOUNT,
        "merchantReference": reference,
        "amount": {"value": value, "currency": "EUR"},
        "eventCode": code,
        "success": success,
        "eventDate": "2026-12-04T10:00:00+01:00",
        **extra,
    }


def test_a_pending_answer_is_not_resent_while_its_notification_is_awaited(
    ledger: AdyenLedger,
) -> None:
    """A `received` refund (Adyen has it, the outcome comes by notification):
    the checks that fall due resend nothing and hand nothing to a person."""
    payment_id = ledger.pay()
    ledger.settle(payment_id, SETTLED)
    ledger.adyen.configure(refund_outcomes=["none"])
    refund_id = ledger.refund(payment_id)
    wait_until(
        lambda: len(ledger.observations(refund_id, "lookup_result")) >= 3,
        30,
        "three checks of the received refund",
    )
    assert len(ledger.requests_for(refund_id)) == 1
    assert not [r for r in ledger.rules(refund_id) if r.startswith("replay")]
    assert ledger.operation(refund_id)["state"] in {"UNKNOWN", "RECONCILIATION_DUE"}
    (refund,) = ledger.refunds_at_adyen(refund_id)
    ledger.adyen.settle(refund["pspReference"], outcome="REFUND")
    assert ledger.settle(refund_id, SETTLED, timeout=15)["outcome"] == "succeeded"


def test_an_outcome_for_another_amount_settles_nothing_and_is_flagged(
    ledger: AdyenLedger,
) -> None:
    ledger.adyen.configure(result_codes=["Pending"], hold_notifications=True)
    op_id = ledger.pay(1000)
    ledger.seen(op_id, "submit_result")
    (payment,) = ledger.payments_at_adyen(op_id)
    response = ledger.notify(_item(payment["pspReference"], op_id, "AUTHORISATION", "true", 1))
    assert response.status_code == 200
    (flagged,) = ledger.observations(op_id, "provider_event")
    assert flagged["verdict"] == "flagged" and "1 EUR" in flagged["reason"]
    assert ledger.operation(op_id)["state"] != "OUTCOME_KNOWN"
    # The same amount settles it.
    ledger.notify(_item(payment["pspReference"], op_id, "AUTHORISATION", "true", 1000))
    assert ledger.settle(op_id, SETTLED, timeout=10)["outcome"] == "succeeded"


def test_a_cancellation_of_a_recorded_success_is_a_contradiction(ledger: AdyenLedger) -> None:
    op_id = ledger.pay()
    op = ledger.settle(op_id, SETTLED)
    cancel = _item(
        "CANCELPSP0000001",
        op_id,
        "CANCELLATION",
        "true",
        1000,
        originalReference=op["provider_reference"],
    )
    assert ledger.notify(cancel).status_code == 200
    wait_until(lambda: ledger.operation(op_id)["outcome_contradicted"], 10, "the contradiction")
