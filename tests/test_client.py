"""The Python client against a real `serve`: a cut-off answer is retried with
the same key and makes one payment; problem documents become typed errors;
`wait` returns an UNKNOWN as what it is; merchant webhook signatures verified
against the Standard Webhooks reference library."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from datetime import UTC, datetime

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from intentledger.client import (
    AsyncClient,
    Client,
    Conflict,
    GaveUp,
    NotFound,
    Retries,
    Unauthorized,
    ValidationFailed,
    WebhookRefused,
    verify_webhook,
)
from tests.served import Served
from tests.support import Forwarder, free_port

FAST = Retries(attempts=4, backoff=0.05, cap=0.5)


def token(served: Served) -> str:
    return served.auth["Authorization"].removeprefix("Bearer ")


class CutFirstAnswer(Forwarder):
    """A TCP forwarder whose first connection's answer is cut off mid-way: the
    request reaches the service, a few bytes of its answer reach the client,
    then the connection is closed."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        super().__init__(port, target)
        self.cut = threading.Event()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            if self.cut.is_set():
                for source, sink in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()
                continue
            self.cut.set()
            threading.Thread(target=self._cut, args=(client, upstream), daemon=True).start()

    def _cut(self, client: socket.socket, upstream: socket.socket) -> None:
        # The request goes through whole, however the client writes it...
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
        with contextlib.suppress(OSError):
            answer = upstream.recv(65536)
            client.sendall(answer[:20])  # ...its answer does not: "HTTP/1.1 202 Accepte"
        for end in (client, upstream):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
                end.close()


def test_a_cut_off_answer_is_retried_with_the_same_key_and_makes_one_payment(
    served: Served,
) -> None:
    port = free_port()
    target = httpx.URL(served.url)
    proxy = CutFirstAnswer(port, (target.host, target.port or 80))
    proxy.start()
    try:
        with Client(f"http://127.0.0.1:{port}", token(served), retries=FAST) as client:
            began = time.monotonic()
            operation = client.pay(990, "EUR", "pm_ok", idempotency_key="client-cut-1")
            assert proxy.cut.is_set()
            assert time.monotonic() - began < 5  # retried at once, not after a timeout
            assert operation.replayed  # the second answer is the first request's, replayed
            settled = client.wait(operation.id, timeout=20)
    finally:
        proxy.stop()
    assert settled.state == "OUTCOME_KNOWN" and settled.outcome == "succeeded"
    assert served.charges(operation.id) == 1


def test_problem_documents_become_typed_errors(served: Served) -> None:
    with Client(served.url, token(served), retries=FAST) as client:
        with pytest.raises(ValidationFailed) as invalid:
            client.pay(100, "EURO", "pm_ok")
        assert invalid.value.status in (400, 422) and invalid.value.detail
        with pytest.raises(NotFound):
            client.operation("op_000000000000000000000000")
        client.pay(100, "EUR", "pm_ok", idempotency_key="client-conflict")
        with pytest.raises(Conflict) as conflict:
            client.pay(101, "EUR", "pm_ok", idempotency_key="client-conflict")
        assert conflict.value.type.endswith("idempotency-key-reused")
    with (
        Client(served.url, "il_not_a_token", retries=FAST) as stranger,
        pytest.raises(Unauthorized),
    ):
        stranger.pay(100, "EUR", "pm_ok")


def test_an_unknown_outcome_is_returned_as_what_it_is(served: Served) -> None:
    with Client(served.url, token(served), retries=FAST) as client:
        operation = client.pay(990, "EUR", "pm_blackhole")
        waited = client.wait(operation.id, timeout=3)
    assert waited.state in ("SUBMITTING", "UNKNOWN", "RECONCILIATION_DUE", "SAFETY_REVIEW")
    assert not waited.settled and waited.outcome is None


def test_nobody_answering_gives_up_naming_the_key_to_retry_with() -> None:
    with (
        Client(f"http://127.0.0.1:{free_port()}", "il_x", retries=FAST) as client,
        pytest.raises(GaveUp) as gave_up,
    ):
        client.pay(100, "EUR", "pm_ok", idempotency_key="client-nobody")
    assert gave_up.value.idempotency_key == "client-nobody"


async def test_the_async_client_pays_and_waits(served: Served) -> None:
    async with AsyncClient(served.url, token(served), retries=FAST) as client:
        mandate = await client.create_mandate("EUR", 1000, 5000)
        operation = await client.pay(500, "EUR", "pm_ok", mandate_id=mandate.id)
        settled = await client.wait(operation.id, timeout=20)
        assert settled.outcome == "succeeded"
        assert (await client.mandate(mandate.id)).spent == 500


SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
PAYLOAD = json.dumps({"type": "operation.outcome_known", "data": {"id": "op_1"}})


def signed_by_the_reference(at: datetime) -> dict[str, str]:
    signature = Webhook(SECRET).sign("msg_1", at, PAYLOAD)
    return {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": signature,
    }


def test_verify_webhook_accepts_what_standard_webhooks_signs() -> None:
    headers = signed_by_the_reference(datetime.now(UTC))
    assert verify_webhook(headers, PAYLOAD.encode(), SECRET)["data"]["id"] == "op_1"
    # ...and the reference accepts what it signed, so both read the same scheme.
    assert Webhook(SECRET).verify(PAYLOAD, headers)["data"]["id"] == "op_1"


def test_verify_webhook_refuses_tampered_stale_and_foreign_signatures() -> None:
    now = datetime.now(UTC)
    headers = signed_by_the_reference(now)
    with pytest.raises(WebhookRefused):
        verify_webhook(headers, PAYLOAD.replace("op_1", "op_2").encode(), SECRET)
    stale = signed_by_the_reference(datetime.fromtimestamp(time.time() - 600, UTC))
    with pytest.raises(WebhookRefused, match="tolerance"):
        verify_webhook(stale, PAYLOAD.encode(), SECRET)
    with pytest.raises(WebhookRefused):
        verify_webhook(headers, PAYLOAD.encode(), "whsec_" + "A" * 32)
    with pytest.raises(WebhookRefused):
        verify_webhook({**headers, "webhook-timestamp": "\u00b2"}, PAYLOAD.encode(), SECRET)
