"""A shop's integration, end to end through `intentledger.client` only (issue
35's first Must show), on both databases: pay, wait, refund part, list the
refunds and wait for the refund, register a webhook endpoint, receive and
verify the events, and drop a stale one by its version.

A real `intentledger serve` (workers, sandbox) sends the events to a receiver
on loopback. The payment's answer is lost at the provider (the sandbox's
`pm_timeout_after_execute`), so the payment is news twice — UNKNOWN, then
known — and the earlier event, arriving again after the later one, is stale."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from intentledger.client import Client, Retries, WebhookRefused, is_newer, verify_webhook
from tests.served import Served
from tests.test_client import serving_with_webhooks, token
from tests.webhook_receiver import Received, Receiver, receiving


@pytest.fixture
def shop_ledger(database_url: str, tmp_path: Path) -> Iterator[Served]:
    with serving_with_webhooks(database_url, tmp_path) as served:
        yield served


class Shop:
    """What a shop keeps of the ledger's news: each object as last seen, by version."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.seen: dict[str, dict[str, Any]] = {}
        self.dropped: list[dict[str, Any]] = []

    def receive(self, received: Received) -> None:
        event = verify_webhook(received.headers, received.body, self.secret)
        data = event["data"]
        known = self.seen.get(data["id"])
        if not is_newer(event, None if known is None else known["version"]):
            self.dropped.append(event)
            return
        self.seen[data["id"]] = data


def arrived(receiver: Receiver, event_type: str, object_id: str) -> Received:
    found: list[Received] = receiver.wait_for(lambda: receiver.of_type(event_type, object_id))
    return found[0]


def test_the_shop_scenario_through_the_client_only(shop_ledger: Served) -> None:
    retries = Retries(attempts=6, backoff=0.1, cap=2)
    with (
        receiving() as receiver,
        Client(shop_ledger.url, token(shop_ledger), retries=retries) as client,
    ):
        endpoint = client.create_webhook_endpoint(receiver.url)
        assert endpoint.secret is not None

        payment = client.pay(2500, "EUR", "pm_timeout_after_execute", metadata={"order": "17"})
        paid = client.wait(payment.id, timeout=40)
        assert (paid.state, paid.outcome) == ("OUTCOME_KNOWN", "succeeded")
        assert (paid.amount_refunded, paid.amount_refundable) == (0, 2500)

        refund = client.refund(payment.id, 1000, reason="one item returned")
        assert (refund.kind, refund.payment_id, refund.amount) == ("refund", payment.id, 1000)
        assert [r.id for r in client.refunds(payment.id)] == [refund.id]
        refunded = client.wait(refund.id, timeout=40)
        assert (refunded.state, refunded.outcome) == ("OUTCOME_KNOWN", "succeeded")
        after = client.operation(payment.id)
        assert (after.amount_refunded, after.amount_refundable) == (1000, 1500)

        unknown = arrived(receiver, "operation.unknown", payment.id)
        known = arrived(receiver, "operation.outcome_known", payment.id)
        arrived(receiver, "operation.outcome_known", refund.id)

    shop = Shop(endpoint.secret)
    # Newest first: deliveries are not ordered, so the UNKNOWN may well come last.
    for received in (known, unknown):
        shop.receive(received)
    assert shop.seen[payment.id]["state"] == "OUTCOME_KNOWN"
    assert shop.seen[payment.id]["version"] == paid.version
    assert [e["type"] for e in shop.dropped] == ["operation.unknown"]
    assert shop.dropped[0]["data"]["version"] < paid.version

    # The same bytes again (a retry whose 2xx was lost): not newer either.
    shop.receive(known)
    assert len(shop.dropped) == 2

    # The refund's news, verified, as the refund now reads.
    shop.receive(receiver.of_type("operation.outcome_known", refund.id)[0])
    assert shop.seen[refund.id]["payment_id"] == payment.id
    assert shop.seen[refund.id]["version"] == refunded.version

    # What is not signed with the endpoint's secret is refused before it is read.
    forged = Received(known.headers, known.body.replace(b"succeeded", b"failed"))
    with pytest.raises(WebhookRefused):
        shop.receive(forged)
