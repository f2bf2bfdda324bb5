"""`POST /v1/payments` is served ahead of the middleware stack (api/app.py:
LedgerApp). It must answer exactly as the stack would: the edge's refusals,
the route's problems, the exception handlers' 409, 503 and 500, on both
databases."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.api.app import LedgerApp
from intentledger.app import create_app
from intentledger.engine.api_keys import create_api_key
from intentledger.engine.clock import system_clock
from intentledger.engine.group_intake import IntakeGroups

PAYMENT = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok"}


@pytest.fixture
async def app(engine: AsyncEngine) -> LedgerApp:
    app = create_app(engine, system_clock, "sandbox")
    assert isinstance(app, LedgerApp)
    return app


@pytest.fixture
async def token(engine: AsyncEngine) -> str:
    return await create_api_key(engine, system_clock, "alice", False)


class ThroughTheStack:
    """The same app, with the lane skipped: FastAPI's own `__call__`, whose
    middleware, router and documented route serve the same function."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await FastAPI.__call__(self.app, scope, receive, send)


def client(app: Any, raise_app_exceptions: bool = True) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def refused_requests(token: str) -> list[dict[str, Any]]:
    bearer = {"Authorization": f"Bearer {token}"}
    json_type = {"Content-Type": "application/json"}
    return [
        {"headers": {**json_type, "Idempotency-Key": "k"}, "content": json.dumps(PAYMENT)},
        {"headers": {**bearer, **json_type}, "content": json.dumps(PAYMENT)},
        {"headers": {**bearer, **json_type, "Idempotency-Key": " "}, "content": "{}"},
        {"headers": {**bearer, **json_type, "Idempotency-Key": "k"}, "content": "{"},
        {"headers": {**bearer, **json_type, "Idempotency-Key": "k"}, "content": "[]"},
        {"headers": {**bearer, "Idempotency-Key": "k"}, "content": json.dumps(PAYMENT)},
        {
            "headers": {**bearer, **json_type, "Idempotency-Key": "k"},
            "content": json.dumps({**PAYMENT, "amount": -1}),
        },
        {"headers": {**bearer, **json_type, "Idempotency-Key": "k"}, "content": ""},
    ]


async def test_refusals_are_the_ones_the_stack_gives(app: LedgerApp, token: str) -> None:
    async with client(app) as lane, client(ThroughTheStack(app)) as stack:
        for request in refused_requests(token):
            ours = await lane.post("/v1/payments", **request)
            theirs = await stack.post("/v1/payments", **request)
            assert ours.status_code >= 400, request
            assert (ours.status_code, ours.headers.get("content-type"), ours.json()) == (
                theirs.status_code,
                theirs.headers.get("content-type"),
                theirs.json(),
            ), request
            assert ours.headers.get("www-authenticate") == theirs.headers.get("www-authenticate")


async def test_a_reused_key_is_the_refusal_handlers_409(app: LedgerApp, token: str) -> None:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "once"}
    async with client(app) as lane:
        assert (await lane.post("/v1/payments", headers=headers, json=PAYMENT)).status_code == 202
        again = await lane.post("/v1/payments", headers=headers, json={**PAYMENT, "amount": 1})
    assert again.status_code == 409
    assert again.headers["content-type"].startswith("application/problem+json")
    assert again.json()["instance"] == "/v1/payments"


async def test_a_database_that_does_not_answer_is_503_with_retry_after(
    app: LedgerApp, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def unreachable(_self: IntakeGroups, _intent: Any) -> Any:
        raise OperationalError("INSERT ...", {}, ConnectionError("server closed the connection"))

    monkeypatch.setattr(IntakeGroups, "accept", unreachable)
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "k"}
    async with client(app, raise_app_exceptions=False) as lane:
        response = await lane.post("/v1/payments", headers=headers, json=PAYMENT)
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["type"].endswith("/database-unavailable")


async def test_an_unexpected_error_is_a_500_problem_and_still_raised_for_the_log(
    app: LedgerApp, token: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(_self: IntakeGroups, _intent: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(IntakeGroups, "accept", broken)
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "k"}
    async with client(app, raise_app_exceptions=False) as lane:
        response = await lane.post("/v1/payments", headers=headers, json=PAYMENT)
    assert response.status_code == 500
    assert response.headers["content-type"].startswith("application/problem+json")
    assert response.json()["detail"] == "an unexpected error occurred"  # nothing of the bug
    async with client(app) as lane:
        with pytest.raises(RuntimeError, match="a bug"):
            await lane.post("/v1/payments", headers=headers, json=PAYMENT)


async def test_other_methods_take_the_stack_and_405_names_every_allowed_method(
    app: LedgerApp, token: str
) -> None:
    """RFC 9110 §15.5.6: a 405 carries Allow. FastAPI keeps included routers'
    routes inside them, where a plain walk of the app's routes found none."""
    bearer = {"Authorization": f"Bearer {token}"}
    async with client(app) as lane:
        payments = await lane.get("/v1/payments", headers=bearer)
        endpoint = await lane.put("/v1/webhook-endpoints/we_x", headers=bearer)
        refunds = await lane.delete("/v1/payments/op_x/refunds", headers=bearer)
    assert payments.status_code == endpoint.status_code == refunds.status_code == 405
    assert payments.headers["allow"] == "POST"
    assert endpoint.headers["allow"] == "DELETE, GET"  # FastAPI's routes add no HEAD
    assert refunds.headers["allow"] == "GET, POST"
    assert payments.headers["content-type"].startswith("application/problem+json")
