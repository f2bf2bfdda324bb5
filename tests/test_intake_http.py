"""Intake over real HTTP against `intentledger serve --no-workers`, on both databases."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import insert, select

from intentledger.engine.api_keys import TOKEN_PREFIX, hash_token
from intentledger.ports import free_port
from intentledger.store.database import create_sync_engine
from intentledger.store.tables import api_keys, idempotency_records, metadata, operations, outbox
from tests.conftest import BACKENDS, Databases
from tests.support import Process

SEED_FIELDS = {
    "operation_id",
    "idempotency_key",
    "state",
    "request_context",
    "first_attempt_at",
    "last_observed_at",
    "retry_after_at",
    "reconciliation_status",
    "key_age_at_decision",
    "provider_retention_note",
    "next_action",
}
PAYMENT = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok"}


@dataclass
class Service:
    url: str
    database_url: str
    tokens: dict[str, str]

    def headers(self, actor: str = "alice", key: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.tokens[actor]}"}
        if key is not None:
            headers["Idempotency-Key"] = key
        return headers

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table: what 'nothing written' is checked against."""
        engine = create_sync_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return {
                    table.name: sorted(map(tuple, conn.execute(select(table))), key=repr)
                    for table in metadata.sorted_tables
                }
        finally:
            engine.dispose()


def create_key(database_url: str, actor: str, operator: bool = False) -> str:
    """A key stored the way `intentledger keys create` stores one (its own test is
    in test_cli.py). Written here in process: the command's start-up cost two
    seconds a key, and the served tests make two keys each."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    engine = create_sync_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                insert(api_keys).values(
                    token_hash=hash_token(token),
                    actor=actor,
                    is_operator=operator,
                    created_at=datetime.now(UTC),
                )
            )
    finally:
        engine.dispose()
    return token


@contextmanager
def serving(database_url: str, workdir: Path, *extra: str) -> Iterator[str]:
    """`intentledger serve --no-workers` on `database_url`; yields its base URL."""
    port = free_port()
    proc = Process(
        [
            "serve",
            "--no-workers",
            "--port",
            str(port),
            "--database-url",
            database_url,
            "--sandbox-database",
            str(workdir / "sandbox.db"),
            *extra,
        ],
        {},
        workdir / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_healthy(url + "/healthz")
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=BACKENDS)
def service(
    request: pytest.FixtureRequest, databases: Databases, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    database_url = databases.create(str(request.param))
    tokens = {actor: create_key(database_url, actor) for actor in ("alice", "bob")}
    with serving(database_url, tmp_path_factory.mktemp("serve")) as url:
        yield Service(url, database_url, tokens)


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body = response.json()
    assert body["status"] == status and body["title"] and body["detail"] and body["type"]
    return body


async def test_fifty_concurrent_equal_posts_make_one_operation(service: Service) -> None:
    key = "concurrent-equal-1"
    async with httpx.AsyncClient(base_url=service.url, timeout=30) as client:
        responses = await asyncio.gather(
            *(
                client.post("/v1/payments", json=PAYMENT, headers=service.headers(key=key))
                for _ in range(50)
            )
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 49 + [202]
    assert {r.json()["id"] for r in responses} == {responses[0].json()["id"]}
    assert sum(r.headers.get("idempotent-replayed") == "true" for r in responses) == 49
    assert all("idempotent-replayed" not in r.headers for r in responses if r.status_code == 202)

    engine = create_sync_engine(service.database_url)
    with engine.connect() as conn:
        ops = conn.execute(select(operations).where(operations.c.idempotency_key == key)).all()
        assert len(ops) == 1
        op_id = ops[0].operation_id
        assert len(conn.execute(select(outbox).where(outbox.c.operation_id == op_id)).all()) == 1
        assert (
            len(
                conn.execute(
                    select(idempotency_records).where(idempotency_records.c.idempotency_key == key)
                ).all()
            )
            == 1
        )
    engine.dispose()


def test_first_request_is_202_with_the_ledger_record(service: Service) -> None:
    response = httpx.post(
        f"{service.url}/v1/payments", json=PAYMENT, headers=service.headers(key="first-202")
    )
    assert response.status_code == 202
    body = response.json()
    assert body.keys() >= SEED_FIELDS
    assert body["id"] == body["operation_id"] and body["id"].startswith("op_")
    assert body["state"] == "ACCEPTED" and body["next_action"] == "submit"
    assert body["amount"] == 1250 and body["currency"] == "EUR" and body["attempts"] == []
    assert body["request_context"]["body"]["payment_method"] == "pm_ok"


def test_same_key_other_body_is_409_and_writes_nothing(service: Service) -> None:
    headers = service.headers(key="conflict-1")
    assert (
        httpx.post(f"{service.url}/v1/payments", json=PAYMENT, headers=headers).status_code == 202
    )
    before = service.snapshot()
    response = httpx.post(
        f"{service.url}/v1/payments", json={**PAYMENT, "amount": 1251}, headers=headers
    )
    assert_problem(response, 409)
    assert service.snapshot() == before


def test_equal_bodies_in_another_key_order_and_spacing_replay(service: Service) -> None:
    headers = service.headers(key="canonical-1")
    first = httpx.post(f"{service.url}/v1/payments", json=PAYMENT, headers=headers)
    reordered = json.dumps(dict(reversed(PAYMENT.items())), indent=3).replace("EUR", "eur")
    second = httpx.post(
        f"{service.url}/v1/payments",
        content=reordered,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert (first.status_code, second.status_code) == (202, 200)
    assert second.json()["id"] == first.json()["id"]


def test_same_key_from_another_actor_is_that_actors_own_operation(service: Service) -> None:
    key = "shared-key-1"
    alice = httpx.post(
        f"{service.url}/v1/payments", json=PAYMENT, headers=service.headers("alice", key)
    )
    bob = httpx.post(
        f"{service.url}/v1/payments", json=PAYMENT, headers=service.headers("bob", key)
    )
    assert (alice.status_code, bob.status_code) == (202, 202)
    assert alice.json()["id"] != bob.json()["id"]
    assert bob.json()["actor"] == "bob"


def test_operation_is_readable_by_its_actor_only(service: Service) -> None:
    created = httpx.post(
        f"{service.url}/v1/payments", json=PAYMENT, headers=service.headers(key="read-1")
    ).json()
    own = httpx.get(f"{service.url}/v1/operations/{created['id']}", headers=service.headers())
    assert own.status_code == 200 and own.json() == created
    other = httpx.get(
        f"{service.url}/v1/operations/{created['id']}", headers=service.headers("bob")
    )
    assert_problem(other, 404)
    assert_problem(
        httpx.get(f"{service.url}/v1/operations/op_missing", headers=service.headers()), 404
    )
    assert_problem(
        httpx.get(
            f"{service.url}/v1/operations/{created['id']}/events", headers=service.headers("bob")
        ),
        404,
    )
    events = httpx.get(
        f"{service.url}/v1/operations/{created['id']}/events", headers=service.headers()
    )
    assert events.status_code == 200
    [accepted] = events.json()["data"]
    assert (
        accepted["type"] == "transition" and accepted["to_state"] == "ACCEPTED" and accepted["at"]
    )


def test_health_and_openapi_are_served(service: Service) -> None:
    assert httpx.get(f"{service.url}/healthz").json() == {"status": "ok"}
    spec = httpx.get(f"{service.url}/openapi.json").json()
    post = spec["paths"]["/v1/payments"]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    assert set(schema["required"]) == {"amount", "currency", "payment_method"}
    headers = {p["name"]: p for p in post["parameters"] if p["in"] == "header"}
    assert headers["Idempotency-Key"]["required"] is True
    assert "/v1/operations/{operation_id}/events" in spec["paths"]


def _big_body() -> bytes:
    return json.dumps({**PAYMENT, "description": "x" * 70_000}).encode()


BAD_REQUESTS: list[tuple[str, dict[str, Any], Any, int]] = [
    # (case, header overrides, body, expected status); None removes a header.
    ("missing key", {"Idempotency-Key": None}, PAYMENT, 400),
    ("256-character key", {"Idempotency-Key": "k" * 256}, PAYMENT, 400),
    ("empty key", {"Idempotency-Key": ""}, PAYMENT, 400),
    ("non-ASCII key", {"Idempotency-Key": "clé-1".encode()}, PAYMENT, 400),
    ("key with a space", {"Idempotency-Key": "two words"}, PAYMENT, 400),
    ("non-JSON body", {}, b"amount=100&currency=EUR", 400),
    ("truncated JSON", {}, b'{"amount": 100,', 400),
    ("invalid UTF-8", {}, b'{"amount": "\xff"}', 400),
    ("JSON array", {}, [PAYMENT], 422),
    ("amount as string", {}, {**PAYMENT, "amount": "1250"}, 422),
    ("amount as float", {}, {**PAYMENT, "amount": 12.5}, 422),
    ("amount as boolean", {}, {**PAYMENT, "amount": True}, 422),
    ("negative amount", {}, {**PAYMENT, "amount": -5}, 422),
    ("zero amount", {}, {**PAYMENT, "amount": 0}, 422),
    ("unknown currency", {}, {**PAYMENT, "currency": "XYZ"}, 422),
    ("withdrawn currency", {}, {**PAYMENT, "currency": "DEM"}, 422),
    ("currency as number", {}, {**PAYMENT, "currency": 978}, 422),
    ("missing payment_method", {}, {"amount": 5, "currency": "EUR"}, 422),
    ("unknown field", {}, {**PAYMENT, "amout": 5}, 422),
    ("metadata not strings", {}, {**PAYMENT, "metadata": {"a": 1}}, 422),
    ("unknown mandate", {}, {**PAYMENT, "mandate_id": "md_nope"}, 422),
    ("70 KB body", {}, _big_body(), 413),
    ("missing token", {"Authorization": None}, PAYMENT, 401),
    ("wrong token", {"Authorization": "Bearer il_not-a-real-token"}, PAYMENT, 401),
    ("not a bearer token", {"Authorization": "Basic YWxpY2U6cHc="}, PAYMENT, 401),
]


@pytest.mark.parametrize(
    ("case", "overrides", "body", "status"), BAD_REQUESTS, ids=[case for case, *_ in BAD_REQUESTS]
)
def test_bad_input_gets_a_problem_and_changes_nothing(
    service: Service, case: str, overrides: dict[str, Any], body: Any, status: int
) -> None:
    headers: dict[str, Any] = {
        **service.headers(key="bad-" + case.replace(" ", "-")),
        "Content-Type": "application/json",
    }
    for name, value in overrides.items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = service.snapshot()
    response = httpx.post(f"{service.url}/v1/payments", content=content, headers=headers)
    problem = assert_problem(response, status)
    if status == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")
    if status == 422 and case not in ("JSON array", "unknown mandate"):
        assert problem["errors"], problem
    assert service.snapshot() == before
