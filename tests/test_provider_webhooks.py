"""Provider webhooks as evidence, end to end: `serve --provider stripe` with a
webhook secret, localstripe's own signed webhooks, and events signed by the
official `stripe` SDK — delivered twice, out of order, tampered, stale, about
references we do not know, and after a person's contrary decision."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import stripe
from sqlalchemy import create_engine, func, select

from intentledger.providers.sandbox.webhooks import SandboxWebhooks, charge_event
from intentledger.store.database import sync_url
from intentledger.store.tables import provider_events
from tests.conftest import BACKENDS, Databases
from tests.served import Served, serve
from tests.stripe_fake import StripeFake, stripe_fake  # noqa: F401
from tests.support import wait_until
from tests.test_intake_http import assert_problem, create_key
from tests.test_stripe import Ledger, serve_stripe

WEBHOOK_SECRET = "whsec_test_intentledger"
# Checks far away: whatever settles a payment here is the webhook, not a lookup.
NO_CHECK_SOON = "120s"
LOCALSTRIPE_HOOK = "intentledger-tests"


class Hooked(Ledger):
    operator: dict[str, str]

    def deliver(self, event: dict[str, Any], *, signed_at: int | None = None) -> httpx.Response:
        """POST `event` as Stripe would, signed by the official SDK."""
        body = json.dumps(event)
        header = stripe.WebhookSignature.generate_signature_header(
            body, WEBHOOK_SECRET, signed_at if signed_at is not None else int(time.time())
        )
        return self.post_raw(body.encode(), header)

    def post_raw(self, body: bytes, signature: str | None) -> httpx.Response:
        headers = {"Content-Type": "application/json; charset=utf-8"}
        if signature is not None:
            headers["Stripe-Signature"] = signature
        return httpx.post(f"{self.url}/v1/provider-webhooks/stripe", content=body, headers=headers)

    def stored_events(self) -> int:
        engine = create_engine(sync_url(self.database_url))
        try:
            with engine.connect() as conn:
                return int(
                    conn.execute(select(func.count()).select_from(provider_events)).scalar_one()
                )
        finally:
            engine.dispose()

    def event_observations(self, op_id: str) -> list[dict[str, Any]]:
        return [o for o in self.observations(op_id) if o["kind"] == "provider_event"]

    def lost_payment(self) -> str:
        """A payment executed at Stripe whose answer never arrives (UNKNOWN)."""
        self.stripe.configure(queue=["hold_after"], hold_seconds=3)
        op_id = self.pay()
        self.settle(op_id, {"UNKNOWN"})
        return op_id


def intent_event(event_id: str, kind: str, intent: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": event_id,
        "object": "event",
        "type": kind,
        "created": int(time.time()),
        "data": {"object": intent},
    }


@pytest.fixture(scope="module", params=BACKENDS)
def hooked_ledger(
    request: pytest.FixtureRequest,
    databases: Databases,
    stripe_fake: StripeFake,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Hooked]:
    database_url = databases.create(str(request.param))
    proc, url = serve_stripe(
        database_url,
        tmp_path_factory.mktemp("hooks"),
        stripe_fake.api_base,
        {"INTENTLEDGER_STRIPE_WEBHOOK_SECRET": f"whsec_test_retired, {WEBHOOK_SECRET}"},
        recheck_backoff=NO_CHECK_SOON,
    )
    try:
        proc.wait_healthy(url + "/healthz")
        ledger = Hooked(
            url,
            database_url,
            {"Authorization": f"Bearer {create_key(database_url, 'stella')}"},
            stripe_fake,
        )
        ledger.operator = {
            "Authorization": f"Bearer {create_key(database_url, 'olive', operator=True)}"
        }
        yield ledger
    finally:
        proc.stop()


@pytest.fixture
def hooked(hooked_ledger: Hooked) -> Hooked:
    hooked_ledger.stripe.reset()
    return hooked_ledger


def _localstripe_webhooks(fake: StripeFake, url: str | None) -> None:
    """Point localstripe's own webhooks at `url` (None: at nothing that happens)."""
    events = ["payment_intent.succeeded", "payment_intent.payment_failed"]
    body = {
        "url": url or "http://127.0.0.1:9/",
        "secret": WEBHOOK_SECRET,
        "events": events if url else ["never.happens"],
    }
    response = httpx.post(f"{fake.truth_base}/_config/webhooks/{LOCALSTRIPE_HOOK}", json=body)
    assert response.status_code == 200, response.text


def test_localstripes_own_signed_webhook_settles_a_lost_answer_before_any_check(
    hooked: Hooked,
) -> None:
    _localstripe_webhooks(hooked.stripe, f"{hooked.url}/v1/provider-webhooks/stripe")
    try:
        hooked.stripe.configure(queue=["hold_after"], hold_seconds=3)
        op_id = hooked.pay()
        op = hooked.settle(op_id, {"OUTCOME_KNOWN"}, timeout=20)
    finally:
        _localstripe_webhooks(hooked.stripe, None)
    (intent,) = hooked.intents_of(op_id)
    assert op["outcome"] == "succeeded" and op["provider_reference"] == intent["id"]
    (event,) = hooked.event_observations(op_id)
    assert event["verdict"] == "succeeded" and event["source"] == "webhook:stripe"
    assert event["detail"]["type"] == "payment_intent.succeeded"
    assert not [o for o in hooked.observations(op_id) if o["kind"] == "lookup_result"]
    assert len(hooked.creates(op_id)) == 1  # nothing was sent again


def test_the_same_event_twice_and_an_older_one_after_it_make_one_effect(hooked: Hooked) -> None:
    op_id = hooked.lost_payment()
    (intent,) = hooked.intents_of(op_id)
    succeeded = intent_event("evt_twice_1", "payment_intent.succeeded", intent)
    first = hooked.deliver(succeeded)
    assert first.status_code == 200, first.text
    assert first.json() == {
        "event_id": "evt_twice_1",
        "disposition": "applied",
        "duplicate": False,
        "operation_id": op_id,
    }
    again = hooked.deliver(succeeded)
    assert again.status_code == 200 and again.json()["duplicate"] is True
    # Delivered out of order: a "processing" event Stripe sent before success.
    earlier = intent_event("evt_twice_0", "payment_intent.processing", intent)
    earlier["data"]["object"] = {**intent, "status": "processing"}
    late = hooked.deliver(earlier)
    assert late.status_code == 200 and late.json()["disposition"] == "recorded"
    op = hooked.operation(op_id)
    assert op["state"] == "OUTCOME_KNOWN" and op["outcome"] == "succeeded"
    assert not op.get("outcome_contradicted") and not op.get("duplicate_detected")
    assert [o["detail"]["event_id"] for o in hooked.event_observations(op_id)] == [
        "evt_twice_1",
        "evt_twice_0",
    ]
    transitions = [e for e in hooked.events(op_id) if e["type"] == "transition"]
    assert [t["to_state"] for t in transitions].count("OUTCOME_KNOWN") == 1


def test_a_tampered_or_stale_signature_is_refused_and_changes_nothing(hooked: Hooked) -> None:
    op_id = hooked.lost_payment()
    (intent,) = hooked.intents_of(op_id)
    event = intent_event("evt_bad_sig", "payment_intent.succeeded", intent)
    before = hooked.stored_events()
    body = json.dumps(event)
    header = stripe.WebhookSignature.generate_signature_header(body, WEBHOOK_SECRET)
    tampered = body.replace('"succeeded"', '"succeeded" ', 1).encode()
    refusals = [
        hooked.post_raw(tampered, header),
        hooked.deliver(event, signed_at=int(time.time()) - 600),  # stale: past 5 minutes
        hooked.post_raw(body.encode(), None),
        hooked.post_raw(body.encode(), header.replace("v1=", "v1=0")),
    ]
    other_secret = stripe.WebhookSignature.generate_signature_header(body, "whsec_someone_else")
    refusals.append(hooked.post_raw(body.encode(), other_secret))
    for response in refusals:
        problem = assert_problem(response, 400)
        assert problem["type"].endswith("signature-refused")
        assert WEBHOOK_SECRET not in response.text
    assert hooked.stored_events() == before
    assert hooked.operation(op_id)["state"] == "UNKNOWN"
    # The retired secret still verifies during the rotation.
    retired = stripe.WebhookSignature.generate_signature_header(body, "whsec_test_retired")
    assert hooked.post_raw(body.encode(), retired).json()["disposition"] == "applied"


def test_an_event_about_a_reference_we_do_not_know_is_stored_and_acknowledged(
    hooked: Hooked,
) -> None:
    stranger = {
        "id": "pi_stranger",
        "object": "payment_intent",
        "status": "succeeded",
        "metadata": {"intentledger_reference": "op_000000000000000000000000"},
    }
    before = hooked.stored_events()
    response = hooked.deliver(intent_event("evt_stranger", "payment_intent.succeeded", stranger))
    assert response.status_code == 200
    assert response.json()["disposition"] == "unknown_reference"
    assert response.json()["operation_id"] is None
    no_reference = {**stranger, "metadata": {}}
    other = hooked.deliver(intent_event("evt_no_ref", "payment_intent.succeeded", no_reference))
    assert other.json()["disposition"] == "unknown_reference"
    unmapped = hooked.deliver(intent_event("evt_customer", "customer.created", {"id": "cus_1"}))
    assert unmapped.status_code == 200 and unmapped.json()["disposition"] == "unmapped_type"
    assert hooked.stored_events() == before + 3
    # A lone surrogate or a NUL PostgreSQL could not store (SQLite would): refused
    # on both databases, not a 500 — a NUL by the edge's strict parse already.
    refusals = {"pi_\\ud800": "unreadable-event", "pi_\\u0000": "malformed-json"}
    for unstorable, refusal in refusals.items():
        odd = json.dumps(intent_event("evt_odd", "payment_intent.succeeded", stranger)).replace(
            "pi_stranger", unstorable
        )
        signed = stripe.WebhookSignature.generate_signature_header(odd, WEBHOOK_SECRET)
        assert assert_problem(hooked.post_raw(odd.encode(), signed), 400)["type"].endswith(refusal)
    assert hooked.stored_events() == before + 3


def test_a_failed_event_settles_a_lost_decline(hooked: Hooked) -> None:
    hooked.stripe.configure(queue=["hold_after"], hold_seconds=3)
    op_id = hooked.pay("pm_card_chargeCustomerFail")
    hooked.settle(op_id, {"UNKNOWN"})
    (intent,) = hooked.intents_of(op_id)
    assert intent["status"] == "requires_payment_method" and intent["last_payment_error"]
    response = hooked.deliver(intent_event("evt_failed", "payment_intent.payment_failed", intent))
    assert response.json()["disposition"] == "applied"
    op = hooked.operation(op_id)
    assert op["state"] == "OUTCOME_KNOWN" and op["outcome"] == "failed"
    assert len(hooked.creates(op_id)) == 1


def test_a_refund_event_settles_a_lost_refund_and_charge_refunded_is_only_kept(
    hooked: Hooked,
) -> None:
    payment = hooked.pay(amount=900)
    intent_id = hooked.settle(payment, {"OUTCOME_KNOWN"})["provider_reference"]
    hooked.stripe.configure(queue=["hold_after"], hold_seconds=3)
    refund_id = hooked.refund(payment, amount=400)
    hooked.settle(refund_id, {"UNKNOWN"})
    [at_stripe] = hooked.refunds_at_stripe(intent_id)
    refund = at_stripe.to_dict()
    charge = {"id": "ch_1", "object": "charge", "payment_intent": intent_id, "refunded": False}
    kept = hooked.deliver(intent_event("evt_charge_refunded", "charge.refunded", charge))
    assert kept.json()["disposition"] in ("unmapped_type", "unknown_reference"), kept.text
    assert hooked.operation(refund_id)["state"] == "UNKNOWN"
    response = hooked.deliver(intent_event("evt_refund_updated", "refund.updated", refund))
    assert response.json()["disposition"] == "applied", response.text
    op = hooked.operation(refund_id)
    assert (op["state"], op["outcome"]) == ("OUTCOME_KNOWN", "succeeded")
    assert op["provider_reference"] == refund["id"]
    shown = hooked.operation(payment)
    assert (shown["amount_refunded"], shown["amount_refundable"]) == (400, 500)


def test_a_webhook_success_after_a_persons_failed_is_flagged(hooked: Hooked) -> None:
    op_id = hooked.lost_payment()
    (intent,) = hooked.intents_of(op_id)
    resolved = httpx.post(
        f"{hooked.url}/v1/ops/operations/{op_id}/resolve",
        json={"outcome": "failed", "evidence": "the customer says the card was declined"},
        headers={**hooked.operator, "Idempotency-Key": f"resolve-{op_id}"},
    )
    assert resolved.status_code == 200, resolved.text
    response = hooked.deliver(intent_event("evt_after_person", "payment_intent.succeeded", intent))
    assert response.json()["disposition"] == "applied"
    op = hooked.operation(op_id)
    assert op["state"] == "OUTCOME_KNOWN" and op["outcome"] == "failed"  # final stays final
    assert op["outcome_contradicted"] is True and op["next_action"] == "operator"


def test_without_a_secret_no_provider_webhook_is_taken(hooked: Hooked) -> None:
    problem = assert_problem(httpx.post(f"{hooked.url}/v1/provider-webhooks/sandbox"), 404)
    assert "sandbox" in problem["detail"]


# -- the sandbox's own signed webhooks ---------------------------------------------------------

SANDBOX_SECRET = "whsec_sandbox_tests"


@pytest.fixture(scope="module", params=BACKENDS)
def sandbox_hooked(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    database_url = databases.create(str(request.param))
    workdir = tmp_path_factory.mktemp("sandbox-hooks")
    proc, url = serve(
        database_url,
        workdir,
        "24h",
        "--recheck-backoff",
        NO_CHECK_SOON,
        "--sandbox-webhook-secret",
        SANDBOX_SECRET,
    )
    try:
        proc.wait_healthy(url + "/healthz")
        auth = {"Authorization": f"Bearer {create_key(database_url, 'sandy')}"}
        yield Served(url, database_url, auth, {})
    finally:
        proc.stop()


def test_the_sandboxs_late_repeated_reordered_webhooks_settle_once_before_any_check(
    sandbox_hooked: Served,
) -> None:
    op_id = sandbox_hooked.pay("pm_webhook_late", f"hook-{time.monotonic_ns()}")
    op = sandbox_hooked.settle(op_id, {"OUTCOME_KNOWN"}, timeout=20)
    assert op["outcome"] == "succeeded"

    def observed_events() -> list[dict[str, Any]]:
        return [
            e
            for e in sandbox_hooked.events(op_id)
            if e["type"] == "observation" and e["kind"] == "provider_event"
        ]

    # The redelivery and the older event come after the first.
    wait_until(lambda: len(observed_events()) >= 2, 15, "the older event to arrive")
    time.sleep(0.5)  # and nothing more after it
    events = sandbox_hooked.events(op_id)
    observed = observed_events()
    # charge.succeeded once (its redelivery was acknowledged and stored nothing),
    # then the older charge.pending, recorded and changing nothing.
    assert [o["detail"]["type"] for o in observed] == ["charge.succeeded", "charge.pending"]
    assert observed[1]["verdict"] == "processing"
    assert not [e for e in events if e["type"] == "observation" and e["kind"] == "lookup_result"]
    transitions = [e["to_state"] for e in events if e["type"] == "transition"]
    assert transitions.count("OUTCOME_KNOWN") == 1
    assert sandbox_hooked.charges(op_id) == 1
    final = sandbox_hooked.operation(op_id)
    assert final["state"] == "OUTCOME_KNOWN" and not final["outcome_contradicted"]
    assert op["provider_reference"] == observed[0]["provider_reference"]


def test_the_sdk_accepts_what_the_sandbox_signs() -> None:
    sender = SandboxWebhooks("http://127.0.0.1:9/", SANDBOX_SECRET)
    event = charge_event("charge.succeeded", "ch_1", "op_x", "succeeded", int(time.time()))
    body, headers = sender.signed(event)
    verified = stripe.Webhook.construct_event(body, headers["Stripe-Signature"], SANDBOX_SECRET)
    assert verified.id == event["id"]


def test_the_same_event_delivered_ten_times_at_once_is_judged_once(hooked: Hooked) -> None:
    op_id = hooked.lost_payment()
    (intent,) = hooked.intents_of(op_id)
    body = json.dumps(intent_event("evt_racing", "payment_intent.succeeded", intent))
    header = stripe.WebhookSignature.generate_signature_header(body, WEBHOOK_SECRET)
    with ThreadPoolExecutor(max_workers=10) as pool:
        answers = list(pool.map(lambda _: hooked.post_raw(body.encode(), header), range(10)))
    assert [a.status_code for a in answers] == [200] * 10
    assert sorted(a.json()["duplicate"] for a in answers) == [False] + [True] * 9
    assert len(hooked.event_observations(op_id)) == 1
    assert hooked.operation(op_id)["outcome"] == "succeeded"
