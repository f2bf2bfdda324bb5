"""Merchant webhooks end to end (issue 15's Must show), on both databases.

A real `intentledger serve` (workers, sandbox) sends to endpoints served by this
test process on loopback (allowed by --webhook-allow-private); what arrives is
verified with the `standardwebhooks` reference library, not our code. The
endpoint API's refusals are checked through the real app, in process, with the
default settings (private targets refused)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import standardwebhooks
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.app import create_app
from intentledger.client import Client, ValidationFailed, WebhookRefused, verify_webhook
from intentledger.engine.api_keys import create_api_key
from intentledger.engine.clock import system_clock
from intentledger.engine.webhook_endpoints import new_secret
from intentledger.store.tables import webhook_endpoints
from tests.conftest import BACKENDS, Databases
from tests.served import Served, serve
from tests.test_intake_http import create_key
from tests.webhook_receiver import receiving

IN_FLIGHT = 2


@pytest.fixture(scope="module", params=BACKENDS)
def merchant(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    database_url = databases.create(str(request.param))
    proc, url = serve(
        database_url,
        tmp_path_factory.mktemp("merchant"),
        "24h",
        "--webhook-allow-private",
        "--webhook-retry-first",
        "200ms",
        # Long enough that a held request is still held when the test looks.
        "--webhook-timeout",
        "30s",
        "--webhook-in-flight",
        str(IN_FLIGHT),
    )
    try:
        proc.wait_healthy(url + "/healthz")
        yield Served(
            url,
            database_url,
            {"Authorization": f"Bearer {create_key(database_url, 'dora')}"},
            {"Authorization": f"Bearer {create_key(database_url, 'erin')}"},
        )
    finally:
        proc.stop()


def register(served: Served, auth: dict[str, str], url: str, **body: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{served.url}/v1/webhook-endpoints",
        json={"url": url, **body},
        headers={**auth, "Idempotency-Key": secrets.token_hex(8)},
    )
    assert response.status_code == 201, response.text
    endpoint: dict[str, Any] = response.json()
    return endpoint


def unregister(served: Served, auth: dict[str, str], endpoint_id: str) -> None:
    response = httpx.delete(f"{served.url}/v1/webhook-endpoints/{endpoint_id}", headers=auth)
    assert response.status_code == 200, response.text


def deliveries(served: Served, auth: dict[str, str], endpoint_id: str) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{served.url}/v1/webhook-endpoints/{endpoint_id}/deliveries",
        params={"limit": 100},
        headers=auth,
    )
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def test_a_payments_outcome_known_arrives_signed_with_its_representation(
    merchant: Served,
) -> None:
    with receiving() as receiver:
        endpoint = register(merchant, merchant.auth, receiver.url)
        try:
            op_id = merchant.pay("pm_ok", secrets.token_hex(8))
            [got] = receiver.wait_for(lambda: receiver.of_type("operation.outcome_known", op_id))
        finally:
            unregister(merchant, merchant.auth, endpoint["id"])
    # The reference library, with the secret shown once at creation.
    payload = standardwebhooks.Webhook(endpoint["secret"]).verify(got.body, got.headers)
    assert payload["type"] == "operation.outcome_known"
    assert got.headers["webhook-id"].startswith("evt_")
    assert payload["data"] == merchant.operation(op_id), "the operation's GET representation"
    assert payload["data"]["state"] == "OUTCOME_KNOWN"
    assert payload["data"]["outcome"] == "succeeded"
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(endpoint["secret"]).verify(got.body + b" ", got.headers)


def test_an_endpoint_down_for_a_while_then_up_receives_every_event(merchant: Served) -> None:
    with receiving() as receiver:
        receiver.mode = "down"
        endpoint = register(
            merchant, merchant.auth, receiver.url, events=["operation.outcome_known"]
        )
        try:
            paid = [merchant.pay("pm_ok", secrets.token_hex(8)) for _ in range(4)]
            # Each delivery fails at least twice while the endpoint is down.
            receiver.wait_for(lambda: receiver.refused >= 2 * len(paid))
            receiver.mode = "up"
            receiver.wait_for(
                lambda: all(receiver.of_type("operation.outcome_known", op) for op in paid)
            )
            sent = receiver.wait_for(
                lambda: (
                    (found := deliveries(merchant, merchant.auth, endpoint["id"]))
                    and all(d["status"] == "delivered" for d in found)
                    and found
                )
            )
        finally:
            unregister(merchant, merchant.auth, endpoint["id"])
    assert sorted(d["object_id"] for d in sent) == sorted(paid), "none lost, none extra"
    for delivery in sent:
        history = delivery["attempts"]
        failed, last = history[:-1], history[-1]
        assert len(failed) >= 1 and all(
            a["http_status"] == 503 and not a["delivered"] and a["next_attempt_at"] for a in failed
        ), history
        assert last["delivered"] and last["http_status"] == 204 and last["next_attempt_at"] is None
    for event in receiver.accepted:
        standardwebhooks.Webhook(endpoint["secret"]).verify(event.body, event.headers)


def test_another_actors_endpoint_never_sees_this_actors_events(merchant: Served) -> None:
    dora, erin = merchant.auth, merchant.operator_auth  # two merchants (neither an operator)
    with receiving() as doras, receiving() as erins:
        mine = register(merchant, dora, doras.url)
        theirs = register(merchant, erin, erins.url)
        try:
            op_id = merchant.pay("pm_ok", secrets.token_hex(8))
            doras.wait_for(lambda: doras.of_type("operation.outcome_known", op_id))
            # Erin's own payment reaches Erin: her endpoint works, and sees only hers.
            response = httpx.post(
                f"{merchant.url}/v1/payments",
                json={"amount": 100, "currency": "EUR", "payment_method": "pm_ok"},
                headers={**erin, "Idempotency-Key": secrets.token_hex(8)},
            )
            hers = response.json()["id"]
            erins.wait_for(lambda: erins.of_type("operation.outcome_known", hers))
            assert {e.payload["data"]["actor"] for e in erins.accepted} == {"erin"}
            assert all(e.payload["data"]["id"] != op_id for e in erins.accepted)
            # Nor can Erin read, list or delete Dora's endpoint.
            for method, path in [
                ("GET", f"/v1/webhook-endpoints/{mine['id']}"),
                ("GET", f"/v1/webhook-endpoints/{mine['id']}/deliveries"),
                ("DELETE", f"/v1/webhook-endpoints/{mine['id']}"),
            ]:
                answer = httpx.request(method, merchant.url + path, headers=erin)
                assert answer.status_code == 404, (method, path, answer.text)
            listed = httpx.get(f"{merchant.url}/v1/webhook-endpoints", headers=erin).json()
            assert [e["id"] for e in listed["data"]] == [theirs["id"]]
        finally:
            unregister(merchant, dora, mine["id"])
            unregister(merchant, erin, theirs["id"])


def test_a_slow_endpoint_never_delays_payments(merchant: Served) -> None:
    with receiving() as receiver:
        receiver.mode = "hold"
        endpoint = register(merchant, merchant.auth, receiver.url)
        try:
            paid = [merchant.pay("pm_ok", secrets.token_hex(8)) for _ in range(6)]
            # Every payment settles while the endpoint holds every request it got.
            for op_id in paid:
                merchant.settle(op_id, {"OUTCOME_KNOWN"})
            receiver.wait_for(lambda: receiver.concurrent >= IN_FLIGHT)
            assert receiver.accepted == []
            assert receiver.most_concurrent == IN_FLIGHT, "the per-endpoint limit"
            receiver.mode = "up"
            receiver.released.set()
            receiver.wait_for(
                lambda: all(receiver.of_type("operation.outcome_known", op) for op in paid)
            )
        finally:
            unregister(merchant, merchant.auth, endpoint["id"])
    assert receiver.most_concurrent == IN_FLIGHT


# -- the endpoint API's refusals, in process, with private targets refused -----------------------


@pytest.fixture
async def api(engine: AsyncEngine) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    token = await create_api_key(engine, system_clock, "ivy", False)
    app = create_app(engine, system_clock, "sandbox")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, {"Authorization": f"Bearer {token}"}


async def stored_endpoints(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(webhook_endpoints))).scalar_one()
        )


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1/hooks",
        "https://10.0.0.8/hooks",
        "https://169.254.169.254/latest/meta-data",
        "https://[::1]/hooks",
        "https://localhost/hooks",  # a name that resolves to loopback
        "http://8.8.8.8/hooks",  # public, but plain http
    ],
)
async def test_a_private_or_plain_url_without_the_setting_is_refused_and_stores_nothing(
    api: tuple[httpx.AsyncClient, dict[str, str]], engine: AsyncEngine, url: str
) -> None:
    client, auth = api
    response = await client.post(
        "/v1/webhook-endpoints", json={"url": url}, headers={**auth, "Idempotency-Key": "k1"}
    )
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"].endswith("/webhook-url-refused")
    # A developer on loopback learns what lifts the refusal.
    assert "INTENTLEDGER_WEBHOOK_ALLOW_PRIVATE=true" in response.json()["detail"], response.text
    assert await stored_endpoints(engine) == 0
    # The key was not used up: a corrected request with it succeeds.
    fixed = await client.post(
        "/v1/webhook-endpoints",
        json={"url": "https://8.8.8.8/hooks"},
        headers={**auth, "Idempotency-Key": "k1"},
    )
    assert fixed.status_code == 201, fixed.text


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 422),
        ({"url": 5}, 422),
        ({"url": "https://8.8.8.8/x", "events": []}, 422),
        ({"url": "https://8.8.8.8/x", "events": ["payment.exploded"]}, 422),
        ({"url": "https://8.8.8.8/x", "events": "card.updated"}, 422),
        ({"url": "https://8.8.8.8/x", "secret": "whsec_mine"}, 422),
        ({"url": "https://8.8.8.8/" + "a" * 3000}, 422),
        ({"url": "https://8.8.8.8/\u0000"}, 400),
        ({"url": "https://8.8.8.8/\u007f"}, 422),
        ({"url": "https://a..example.com/"}, 422),
        ({"url": "https://" + "a" * 64 + ".example.com/"}, 422),
        ({"url": "https://[64:ff9b::a00:5]/"}, 422),  # NAT64 to 10.0.0.5
    ],
)
async def test_bad_bodies_are_refused_and_store_nothing(
    api: tuple[httpx.AsyncClient, dict[str, str]], engine: AsyncEngine, body: Any, status: int
) -> None:
    client, auth = api
    response = await client.post(
        "/v1/webhook-endpoints", json=body, headers={**auth, "Idempotency-Key": "k2"}
    )
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert await stored_endpoints(engine) == 0


async def test_creation_is_idempotent_and_the_secret_is_never_read_back(
    api: tuple[httpx.AsyncClient, dict[str, str]], engine: AsyncEngine
) -> None:
    client, auth = api
    body = {"url": "https://8.8.8.8/hooks", "events": ["card.updated", "operation.unknown"]}
    no_key = await client.post("/v1/webhook-endpoints", json=body, headers=auth)
    assert no_key.status_code == 400
    first = await client.post(
        "/v1/webhook-endpoints", json=body, headers={**auth, "Idempotency-Key": "k3"}
    )
    assert first.status_code == 201 and first.json()["secret"].startswith("whsec_")
    # The same subscriptions in another order are the same request.
    reordered = {**body, "events": ["operation.unknown", "card.updated"]}
    again = await client.post(
        "/v1/webhook-endpoints", json=reordered, headers={**auth, "Idempotency-Key": "k3"}
    )
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json(), "a lost answer's secret is not lost with it"
    other = await client.post(
        "/v1/webhook-endpoints",
        json={"url": "https://8.8.4.4/hooks"},
        headers={**auth, "Idempotency-Key": "k3"},
    )
    assert other.status_code == 409
    assert await stored_endpoints(engine) == 1

    endpoint_id = first.json()["id"]
    read = await client.get(f"/v1/webhook-endpoints/{endpoint_id}", headers=auth)
    assert read.status_code == 200 and "secret" not in read.json()
    listed = await client.get("/v1/webhook-endpoints", headers=auth)
    assert all("secret" not in e for e in listed.json()["data"])
    for query in ("limit=0", "limit=101", "starting_after=x", "starting_after=-1"):
        bad = await client.get(
            f"/v1/webhook-endpoints/{endpoint_id}/deliveries?{query}", headers=auth
        )
        assert bad.status_code == 422, (query, bad.text)
    assert (await client.delete(f"/v1/webhook-endpoints/{endpoint_id}", headers=auth)).json() == {
        "id": endpoint_id,
        "deleted": True,
    }
    # Deleted, it reads back as what it is (a replay of its creation answers
    # with it), leaves the list, and a second DELETE changes nothing.
    read = await client.get(f"/v1/webhook-endpoints/{endpoint_id}", headers=auth)
    assert read.status_code == 200 and read.json()["deleted_at"], read.text
    listed = await client.get("/v1/webhook-endpoints", headers=auth)
    assert endpoint_id not in [e["id"] for e in listed.json()["data"]]
    replayed = await client.post(
        "/v1/webhook-endpoints", json=body, headers={**auth, "Idempotency-Key": "k3"}
    )
    assert (
        replayed.status_code == 200 and replayed.json()["deleted_at"] == read.json()["deleted_at"]
    )
    again = await client.delete(f"/v1/webhook-endpoints/{endpoint_id}", headers=auth)
    assert again.status_code == 200 and again.json() == {"id": endpoint_id, "deleted": True}
    assert (await client.get(f"/v1/webhook-endpoints/{endpoint_id}", headers=auth)).json()[
        "deleted_at"
    ] == read.json()["deleted_at"]


def test_the_client_registers_an_endpoint_and_verifies_what_it_receives(merchant: Served) -> None:
    token = merchant.auth["Authorization"].removeprefix("Bearer ")
    with receiving() as receiver, Client(merchant.url, token) as client:
        endpoint = client.create_webhook_endpoint(
            receiver.url, ["operation.outcome_known"], idempotency_key=secrets.token_hex(8)
        )
        try:
            assert endpoint.secret and endpoint.secret.startswith("whsec_")
            operation = client.pay(700, "EUR", "pm_ok")
            [got] = receiver.wait_for(
                lambda: receiver.of_type("operation.outcome_known", operation.id)
            )
        finally:
            unregister(merchant, merchant.auth, endpoint.id)
        with pytest.raises(ValidationFailed):
            client.create_webhook_endpoint("ftp://example.com/hooks")
    assert verify_webhook(got.headers, got.body, endpoint.secret)["data"]["id"] == operation.id
    with pytest.raises(WebhookRefused):
        verify_webhook(got.headers, got.body, new_secret())
