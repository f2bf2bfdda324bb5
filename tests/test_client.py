"""The Python client against a real `serve`: a cut-off answer is retried with
the same key and makes one payment (one refund, one card, one beneficiary);
every route the API offers is reached, sync and async; problem documents
become typed errors; `wait` returns an UNKNOWN as what it is; merchant webhook
signatures verified against the Standard Webhooks reference library; `is_newer`
tells a stale event."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks.webhooks import Webhook

from intentledger.client import (
    AsyncClient,
    BadAnswer,
    Card,
    Client,
    Conflict,
    Delivery,
    DeliveryPage,
    GaveUp,
    Mandate,
    NotFound,
    Operation,
    Retries,
    Unauthorized,
    Unavailable,
    ValidationFailed,
    WebhookEndpoint,
    WebhookRefused,
    is_newer,
    verify_webhook,
)
from intentledger.ports import free_port
from tests.served import Served, serve
from tests.support import Forwarder
from tests.test_intake_http import create_key
from tests.webhook_receiver import receiving

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


OPERATION = {
    "id": "op_1",
    "state": "UNKNOWN",
    "next_action": "reconcile",
    "kind": "payment",
    "version": 3,
}


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


# -- every route, sync and async ----------------------------------------------------------------

IBAN = "DE89 3704 0044 0532 0130 00"


class Either:
    """A sync or an async client, called one way: every method is awaited."""

    def __init__(self, client: Client | AsyncClient) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return call


@contextlib.asynccontextmanager
async def either(
    flavour: str,
    base_url: str,
    secret_token: str,
    retries: Retries = FAST,
    transport: httpx.MockTransport | None = None,
) -> Any:
    if flavour == "sync":
        with Client(base_url, secret_token, retries=retries, transport=transport) as client:
            yield Either(client)
    else:
        async with AsyncClient(
            base_url, secret_token, retries=retries, transport=transport
        ) as async_client:
            yield Either(async_client)


@contextlib.contextmanager
def serving_with_webhooks(database_url: str, workdir: Path) -> Iterator[Served]:
    """`serve` (workers, sandbox) that may send merchant webhooks to loopback."""
    proc, url = serve(
        database_url, workdir, "24h", "--webhook-allow-private", "--webhook-retry-first", "200ms"
    )
    try:
        proc.wait_healthy(url + "/healthz")
        yield Served(
            url,
            database_url,
            {"Authorization": f"Bearer {create_key(database_url, 'dora')}"},
            {"Authorization": f"Bearer {create_key(database_url, 'olive', operator=True)}"},
        )
    finally:
        proc.stop()


@pytest.fixture
def hooked(database_url: str, tmp_path: Path) -> Iterator[Served]:
    with serving_with_webhooks(database_url, tmp_path) as served:
        yield served


def all_delivered(deliveries: list[Delivery], expected: int) -> bool:
    return len(deliveries) == expected and all(d.status == "delivered" for d in deliveries)


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_every_route_through_the_client(hooked: Served, flavour: str) -> None:
    async with either(flavour, hooked.url, token(hooked)) as client:
        # Payments and refunds.
        payment = await client.pay(1000, "EUR", "pm_ok")
        paid = await client.wait(payment.id, timeout=20)
        assert (paid.outcome, paid.kind, paid.amount_refundable, paid.amount_refunded) == (
            "succeeded",
            "payment",
            1000,
            0,
        )
        assert paid.version > payment.version and paid.payment_id is None
        refund = await client.refund(payment.id, 300, reason="damaged")
        assert (refund.kind, refund.payment_id, refund.amount) == ("refund", payment.id, 300)
        assert refund.amount_refundable is None
        refunded = await client.wait(refund.id, timeout=20)
        assert refunded.outcome == "succeeded"
        assert [r.id for r in await client.refunds(payment.id)] == [refund.id]
        after = await client.operation(payment.id)
        assert (after.amount_refunded, after.amount_refundable) == (300, 700)
        timeline = await client.events(payment.id)
        assert {e.type for e in timeline} <= {"transition", "observation", "decision"}
        assert timeline[-1].type == "transition" and timeline[-1].raw["to_state"] == "OUTCOME_KNOWN"

        # Endpoints, registered before the mandate changes they will hear of.
        with receiving() as receiver:
            endpoint = await client.create_webhook_endpoint(receiver.url, ["mandate.updated"])
            other = await client.create_webhook_endpoint(receiver.url + "/other", ["card.updated"])
            assert endpoint.secret and endpoint.events == ["mandate.updated"]

            mandate = await client.create_mandate("EUR", 500, 2000)
            suspended = await client.suspend_mandate(mandate.id, idempotency_key=f"sus-{flavour}")
            again = await client.suspend_mandate(mandate.id, idempotency_key=f"sus-{flavour}")
            resumed = await client.resume_mandate(mandate.id)
            revoked = await client.revoke_mandate(mandate.id)
            assert (suspended.status, resumed.status, revoked.status) == (
                "suspended",
                "active",
                "revoked",
            )
            assert again.replayed and not suspended.replayed and again.id == mandate.id
            assert mandate.version < suspended.version < resumed.version < revoked.version

            # Received, then recorded as delivered: wait for the record.
            deadline = time.monotonic() + 30
            while not all_delivered((await client.deliveries(endpoint.id)).deliveries, 3):
                assert time.monotonic() < deadline, receiver.accepted
                await asyncio.sleep(0.1)
            assert len(receiver.of_type("mandate.updated", mandate.id)) == 3
            first: DeliveryPage = await client.deliveries(endpoint.id, limit=2)
            assert len(first.deliveries) == 2 and first.has_more
            assert first.next_starting_after == first.deliveries[-1].id
            rest = await client.deliveries(endpoint.id, starting_after=first.next_starting_after)
            assert len(rest.deliveries) == 1 and not rest.has_more
            assert rest.next_starting_after is None
            every = first.deliveries + rest.deliveries
            assert {d.object_id for d in every} == {mandate.id}
            assert [d.id for d in every] == sorted((d.id for d in every), reverse=True)
            assert all(d.status == "delivered" and d.attempts[-1].delivered for d in every)

            listed = await client.webhook_endpoints()
            assert {e.id for e in listed} == {endpoint.id, other.id}
            assert all(e.secret is None for e in listed)
            read = await client.webhook_endpoint(other.id)
            assert (read.url, read.events, read.secret) == (other.url, ["card.updated"], None)
            await client.delete_webhook_endpoint(other.id)
            assert [e.id for e in await client.webhook_endpoints()] == [endpoint.id]
            # A retried delete (its first answer lost) succeeds and changes nothing.
            deleted = await client.webhook_endpoint(other.id)
            await client.delete_webhook_endpoint(other.id)
            assert deleted.deleted_at and (await client.webhook_endpoint(other.id)) == deleted
            with pytest.raises(NotFound):
                await client.delete_webhook_endpoint("we_" + "0" * 24)

        # Beneficiaries and cards: the provider answers within the request.
        beneficiary = await client.create_beneficiary("Ada Lovelace", IBAN)
        assert (beneficiary.kind, beneficiary.state, beneficiary.outcome) == (
            "beneficiary",
            "OUTCOME_KNOWN",
            "succeeded",
        )
        card = await client.issue_card("travel")
        assert (card.status, card.label, card.indeterminate) == ("active", "travel", False)
        assert card.operation is not None and card.operation.outcome == "succeeded"
        frozen = await client.freeze_card(card.id)
        read_card = await client.card(card.id)
        unfrozen = await client.unfreeze_card(card.id)
        assert (frozen.status, read_card.status, unfrozen.status) == ("frozen", "frozen", "active")
        assert read_card.operation is None and card.version < frozen.version < unfrozen.version
        with pytest.raises(NotFound):
            await client.card("card_000000000000000000000000")


def test_a_cut_off_answer_makes_one_refund_one_card_and_one_beneficiary(served: Served) -> None:
    with Client(served.url, token(served), retries=FAST) as direct:
        payment = direct.wait(direct.pay(800, "EUR", "pm_ok").id, timeout=20)
    assert payment.outcome == "succeeded"
    # Longer than the Retry-After of a 409 request-in-progress: the retry waits for it.
    patient = Retries(attempts=6, backoff=0.05, cap=2)
    writes: list[tuple[str, Callable[[Client], Operation], str]] = [
        ("refunds", lambda c: c.refund(payment.id, 200, idempotency_key="cut-refund"), "ref"),
        ("cards", lambda c: _issued(c.issue_card("cut", idempotency_key="cut-card")), "card"),
        (
            "beneficiaries",
            lambda c: c.create_beneficiary("Cut", IBAN, idempotency_key="cut-ben"),
            "ben",
        ),
    ]
    target = httpx.URL(served.url)
    for truth, write, _ in writes:
        port = free_port()
        proxy = CutFirstAnswer(port, (target.host, target.port or 80))
        proxy.start()
        try:
            with Client(f"http://127.0.0.1:{port}", token(served), retries=patient) as client:
                operation = write(client)
                assert proxy.cut.is_set() and operation.replayed
                settled = client.wait(operation.id, timeout=20)
        finally:
            proxy.stop()
        assert settled.outcome == "succeeded", truth
        made = httpx.get(f"{served.url}/_sandbox/{truth}", params={"reference": operation.id})
        assert len(made.json()["data"]) == 1, (truth, made.text)


def _issued(card: Card) -> Operation:
    assert card.operation is not None
    return card.operation


# -- every write's retries, answer by answer (scripted), sync and async -------------------------

REFUND = {**OPERATION, "id": "op_r", "kind": "refund", "payment_id": "op_p", "amount": 300}
MANDATE = {
    "id": "md_1",
    "status": "suspended",
    "currency": "EUR",
    "max_amount": 100,
    "total_limit": 500,
    "reserved": 0,
    "spent": 0,
    "version": 2,
}
CARD = {
    "id": "card_1",
    "label": "travel",
    "status": "active",
    "indeterminate": False,
    "pending_operation_id": None,
    "provider_card_id": "ic_1",
    "version": 2,
    "operation": {**OPERATION, "id": "op_c", "kind": "card_issue"},
}
ENDPOINT = {"id": "we_1", "url": "https://shop.example/hooks", "events": None, "secret": "whsec_x"}
# Each write: the call, where it goes, what it sends, the answer, and the type it reads as.
KEYED: dict[str, tuple[Callable[[Any], Any], str, Any, dict[str, Any], type]] = {
    "refund": (
        lambda c: c.refund("op_p", 300, reason="damaged"),
        "/v1/payments/op_p/refunds",
        {"amount": 300, "reason": "damaged"},
        REFUND,
        Operation,
    ),
    "refund all": (lambda c: c.refund("op_p"), "/v1/payments/op_p/refunds", {}, REFUND, Operation),
    "beneficiary": (
        lambda c: c.create_beneficiary("Ada", IBAN, sandbox_scenario="declined"),
        "/v1/beneficiaries",
        {"name": "Ada", "iban": IBAN, "sandbox_scenario": "declined"},
        {**OPERATION, "kind": "beneficiary"},
        Operation,
    ),
    "card": (lambda c: c.issue_card("travel"), "/v1/cards", {"label": "travel"}, CARD, Card),
    "freeze": (lambda c: c.freeze_card("card_1"), "/v1/cards/card_1/freeze", {}, CARD, Card),
    "unfreeze": (lambda c: c.unfreeze_card("card_1"), "/v1/cards/card_1/unfreeze", {}, CARD, Card),
    "suspend": (
        lambda c: c.suspend_mandate("md_1"),
        "/v1/mandates/md_1/suspend",
        None,
        MANDATE,
        Mandate,
    ),
    "resume": (
        lambda c: c.resume_mandate("md_1"),
        "/v1/mandates/md_1/resume",
        None,
        MANDATE,
        Mandate,
    ),
    "revoke": (
        lambda c: c.revoke_mandate("md_1"),
        "/v1/mandates/md_1/revoke",
        None,
        MANDATE,
        Mandate,
    ),
    "endpoint": (
        lambda c: c.create_webhook_endpoint("https://shop.example/hooks"),
        "/v1/webhook-endpoints",
        {"url": "https://shop.example/hooks"},
        ENDPOINT,
        WebhookEndpoint,
    ),
}
SCRIPTED_RETRIES = Retries(attempts=6, backoff=0.01, cap=0.5)


def sent_body(request: httpx.Request) -> Any:
    return json.loads(request.content) if request.content else None


@pytest.mark.parametrize("flavour", ["sync", "async"])
@pytest.mark.parametrize("write", list(KEYED))
async def test_every_write_retries_with_its_one_key(flavour: str, write: str) -> None:
    call, path, body, answer, kind = KEYED[write]
    script = Script(
        httpx.ConnectError("refused"),
        problem(503, "database-unavailable", **{"Retry-After": "0"}),
        problem(409, "request-in-progress", **{"Retry-After": "0"}),
        httpx.ReadError("cut off"),
        httpx.Response(200, json=answer, headers={"Idempotent-Replayed": "true"}),
    )
    transport = httpx.MockTransport(script)
    async with either(flavour, "http://ledger.test", "il_x", SCRIPTED_RETRIES, transport) as client:
        result = await call(client)
    keys = script.sent_keys()
    assert len(keys) == 5 and len(set(keys)) == 1 and keys[0]
    assert {(r.method, r.url.path) for r in script.requests} == {("POST", path)}
    assert all(sent_body(r) == body for r in script.requests)
    assert isinstance(result, kind) and result.replayed


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_refused_write_is_not_retried_and_carries_the_key_given(flavour: str) -> None:
    script = Script(problem(422, "refund-exceeds-refundable"), problem(409, "card-busy"))
    transport = httpx.MockTransport(script)
    async with either(flavour, "http://ledger.test", "il_x", SCRIPTED_RETRIES, transport) as client:
        with pytest.raises(ValidationFailed) as refused:
            await client.refund("op_p", 5000, idempotency_key="k-mine")
        with pytest.raises(Conflict) as busy:
            await client.freeze_card("card_1", idempotency_key="k-busy")
    assert script.sent_keys() == ["k-mine", "k-busy"]
    assert (refused.value.idempotency_key, busy.value.idempotency_key) == ("k-mine", "k-busy")


DELIVERY = {
    "id": 7,
    "event_id": "evt_1",
    "type": "operation.outcome_known",
    "object_id": "op_1",
    "status": "failed",
    "in_flight": False,
    "next_attempt_at": None,
    "created_at": "2026-01-01T00:00:00Z",
    "finished_at": "2026-01-04T00:00:00Z",
    "attempts": [
        {
            "at": "2026-01-01T00:00:00Z",
            "duration_ms": 12,
            "http_status": 503,
            "error": None,
            "delivered": False,
            "next_attempt_at": None,
        }
    ],
}


@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_reads_carry_no_key_and_read_their_lists(flavour: str) -> None:
    transition = {"type": "transition", "at": "2026-01-01T00:00:00Z", "to_state": "UNKNOWN"}
    script = Script(
        httpx.Response(200, json={"data": [REFUND]}),
        httpx.Response(200, json={"data": [transition]}),
        httpx.Response(200, json={"data": [{**ENDPOINT, "secret": None}]}),
        httpx.Response(200, json={**ENDPOINT, "secret": None}),
        httpx.Response(200, json={"data": [DELIVERY], "has_more": True}),
        httpx.Response(200, json={"id": "we_1", "deleted": True}),
        httpx.Response(200, json={k: v for k, v in CARD.items() if k != "operation"}),
        httpx.Response(200, json=OPERATION),
        httpx.Response(200, json={"refunds": []}),
    )
    transport = httpx.MockTransport(script)
    async with either(flavour, "http://ledger.test", "il_x", SCRIPTED_RETRIES, transport) as client:
        [refund] = await client.refunds("op_p")
        [event] = await client.events("op_1")
        [endpoint] = await client.webhook_endpoints()
        read = await client.webhook_endpoint("we_1")
        page = await client.deliveries("we_1", limit=1, starting_after=9)
        assert await client.delete_webhook_endpoint("we_1") is None
        card = await client.card("card_1")
        await client.operation("op/../1")
        with pytest.raises(BadAnswer):
            await client.refunds("op_p")  # a list answer without its data
    assert (refund.kind, refund.payment_id, refund.version) == ("refund", "op_p", 3)
    assert (event.type, event.raw["to_state"]) == ("transition", "UNKNOWN")
    assert endpoint.secret is None and read.id == "we_1"
    [delivery] = page.deliveries
    assert page.has_more and page.next_starting_after == 7
    assert (delivery.status, delivery.attempts[0].http_status) == ("failed", 503)
    assert card.operation is None and card.version == 2
    assert all(key is None for key in script.sent_keys())
    assert [(r.method, r.url.raw_path.decode()) for r in script.requests] == [
        ("GET", "/v1/payments/op_p/refunds"),
        ("GET", "/v1/operations/op_1/events"),
        ("GET", "/v1/webhook-endpoints"),
        ("GET", "/v1/webhook-endpoints/we_1"),
        ("GET", "/v1/webhook-endpoints/we_1/deliveries?limit=1&starting_after=9"),
        ("DELETE", "/v1/webhook-endpoints/we_1"),
        ("GET", "/v1/cards/card_1"),
        # An id is one path segment, whatever it holds.
        ("GET", "/v1/operations/op%2F..%2F1"),
        ("GET", "/v1/payments/op_p/refunds"),
    ]


def test_is_newer_drops_what_is_not_later_than_what_was_seen() -> None:
    event = {"type": "operation.outcome_known", "data": {"id": "op_1", "version": 4}}
    assert is_newer(event, None)  # nothing seen yet
    assert is_newer(event, 3)
    assert not is_newer(event, 4)  # a repeat, or another event of the same change
    assert not is_newer(event, 5)  # stale: a newer one arrived first
    for malformed in ({"data": {"id": "op_1"}}, {"data": {"version": "4"}}, {"type": "x"}):
        with pytest.raises(ValueError, match="version"):
            is_newer(malformed, 1)
    with pytest.raises(ValueError, match="version"):
        is_newer({"data": {"version": True}}, 0)
