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
    BadAnswer,
    Client,
    Conflict,
    GaveUp,
    NotFound,
    Retries,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    WebhookRefused,
    verify_webhook,
)
from intentledger.ports import free_port
from tests.served import Served
from tests.support import Forwarder

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
    # Several signatures (a key rotation): any v1 that matches will do.
    rotated = {**headers, "webhook-signature": "v1,bm90IGl0 v2,x " + headers["webhook-signature"]}
    assert verify_webhook(rotated, PAYLOAD.encode(), SECRET)["data"]["id"] == "op_1"
    # The reference reads the secret without its padding too.
    assert verify_webhook(headers, PAYLOAD.encode(), SECRET.rstrip("="))["type"]


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
    future = signed_by_the_reference(datetime.fromtimestamp(time.time() + 600, UTC))
    with pytest.raises(WebhookRefused, match="tolerance"):
        verify_webhook(future, PAYLOAD.encode(), SECRET)
    with pytest.raises(WebhookRefused, match="empty"):
        verify_webhook(headers, PAYLOAD.encode(), "whsec_")


# -- the retry policy, answer by answer (a scripted transport: no server needed) -----------------


class Script:
    """Answers requests from a list, and keeps what each request carried."""

    def __init__(self, *answers: httpx.Response | Exception) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def sent_keys(self) -> list[str | None]:
        return [r.headers.get("idempotency-key") for r in self.requests]


OPERATION = {"id": "op_1", "state": "UNKNOWN", "next_action": "reconcile", "kind": "payment"}


def problem(status: int, slug: str, **headers: str) -> httpx.Response:
    return httpx.Response(
        status,
        json={"type": f"https://intentledger.dev/problems/{slug}", "title": "t", "detail": "d"},
        headers=headers,
    )


def scripted(script: Script) -> Client:
    retries = Retries(attempts=6, backoff=0.01, cap=0.5)
    return Client(
        "http://ledger.test", "il_x", retries=retries, transport=httpx.MockTransport(script)
    )


def test_every_retry_carries_the_same_key_and_an_unknown_is_an_answer() -> None:
    script = Script(
        httpx.ConnectError("refused"),
        problem(503, "database-unavailable", **{"Retry-After": "0"}),
        problem(409, "request-in-progress", **{"Retry-After": "0"}),
        httpx.ReadError("cut off"),
        httpx.Response(200, json=OPERATION, headers={"Idempotent-Replayed": "true"}),
    )
    with scripted(script) as client:
        operation = client.pay(100, "EUR", "pm_ok")
    keys = script.sent_keys()
    assert len(keys) == 5 and len(set(keys)) == 1 and keys[0]
    assert operation.state == "UNKNOWN" and operation.replayed


def test_refusals_are_not_retried_and_carry_the_key() -> None:
    for status, slug, error in (
        (409, "idempotency-key-reused", Conflict),
        (422, "invalid-body", ValidationFailed),
        (404, "operation-not-found", NotFound),
    ):
        script = Script(problem(status, slug))
        with scripted(script) as client, pytest.raises(error) as raised:
            client.pay(100, "EUR", "pm_ok", idempotency_key="k-refused")
        assert len(script.requests) == 1 and raised.value.idempotency_key == "k-refused"


def test_a_retry_after_longer_than_the_cap_ends_the_retries_with_the_key() -> None:
    script = Script(problem(503, "database-unavailable", **{"Retry-After": "3600"}))
    with scripted(script) as client, pytest.raises(Unavailable) as raised:
        client.pay(100, "EUR", "pm_ok", idempotency_key="k-later")
    assert len(script.requests) == 1 and raised.value.idempotency_key == "k-later"


def test_a_malformed_success_is_a_bad_answer_with_the_key() -> None:
    for answer in (httpx.Response(200, text="<html>"), httpx.Response(202, json={"state": "X"})):
        with scripted(Script(answer)) as client, pytest.raises(BadAnswer) as raised:
            client.pay(100, "EUR", "pm_ok", idempotency_key="k-bad")
        assert raised.value.idempotency_key == "k-bad"


def test_a_read_carries_no_key_and_wait_is_bounded_by_its_timeout() -> None:
    script = Script(*[httpx.ReadTimeout("slow") for _ in range(50)])
    with scripted(script) as client:
        began = time.monotonic()
        with pytest.raises(GaveUp):
            client.wait("op_1", timeout=1, poll=0.1)
        assert time.monotonic() - began < 3
    assert all(key is None for key in script.sent_keys())
