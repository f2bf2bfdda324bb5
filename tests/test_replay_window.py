"""The replay window (docs/decisions/0018), on both databases, with an injected
clock: inside it an equal retry replays; after it a reused key is 409
`key-expired` whatever the body, and nothing is written — on every keyed route
(payments alone and in a group, under a mandate, refunds, mandates, webhook
endpoints, operator actions)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.app import create_app
from intentledger.domain.replay_window import (
    DEFAULT_REPLAY_WINDOW,
    SHORTEST_REPLAY_WINDOW,
    replay_window_passed,
)
from intentledger.engine.api_keys import create_api_key
from intentledger.settings import Settings
from intentledger.store import tables
from intentledger.store.group_statement import group_statement_for
from intentledger_tools import blind_retry, short_retention
from intentledger_tools.chaos import CLIENT_PATIENCE_SECONDS
from intentledger_tools.short_retention import SHORTEST_TEST_REPLAY_WINDOW, ShortRetentionSettings
from tests.support import INTENTLEDGER
from tests.test_recovery_model import START, ControlledClock

WINDOW = timedelta(days=30)
PAYMENT = {"amount": 990, "currency": "EUR", "payment_method": "pm_ok"}


class Api:
    def __init__(self, client: httpx.AsyncClient, clock: ControlledClock, engine: AsyncEngine):
        self.client = client
        self.clock = clock
        self.engine = engine
        self.auth: dict[str, str] = {}
        self.operator: dict[str, str] = {}

    async def post(
        self, path: str, body: dict[str, Any], key: str, operator: bool = False
    ) -> httpx.Response:
        headers = {**(self.operator if operator else self.auth), "Idempotency-Key": key}
        return await self.client.post(path, json=body, headers=headers)

    async def counts(self) -> dict[str, int]:
        counted = {}
        async with self.engine.connect() as conn:
            for table in (
                tables.operations,
                tables.idempotency_records,
                tables.outbox,
                tables.mandates,
                tables.decisions,
                tables.transitions,
            ):
                counted[table.name] = (
                    await conn.execute(select(func.count()).select_from(table))
                ).scalar_one()
        return counted


@pytest.fixture
async def api(engine: AsyncEngine, database_url: str) -> AsyncIterator[Api]:
    clock = ControlledClock()
    # As `serve` builds it: on PostgreSQL intake's groups go over a connection
    # of their own, and their retries are judged after the statement commits.
    group_statement = group_statement_for(database_url)
    # Private webhook targets allowed: an endpoint on loopback needs no DNS.
    app = create_app(
        engine,
        clock,
        "sandbox",
        replay_window=WINDOW,
        webhook_allow_private=True,
        group_statement=group_statement,
    )
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            made = Api(client, clock, engine)
            made.auth = {
                "Authorization": f"Bearer {await create_api_key(engine, clock, 'dora', False)}"
            }
            made.operator = {
                "Authorization": f"Bearer {await create_api_key(engine, clock, 'olive', True)}"
            }
            yield made
    finally:
        if group_statement is not None:
            await group_statement.close()


async def expired(
    api: Api,
    path: str,
    body: dict[str, Any],
    key: str,
    other: dict[str, Any] | None = None,
    **kw: Any,
) -> None:
    """After the window: the same request, and another under the same key, are
    both refused as expired, and nothing is written."""
    before = await api.counts()
    for sent in (body, other) if other is not None else (body,):
        answer = await api.post(path, sent, key, **kw)
        assert answer.status_code == 409, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["type"].endswith("/key-expired"), problem
        assert "replay window" in problem["detail"]
    assert await api.counts() == before


async def test_a_payment_replays_inside_the_window_and_is_refused_after_it(api: Api) -> None:
    first = await api.post("/v1/payments", PAYMENT, "pay-1")
    assert first.status_code == 202
    api.clock.advance(WINDOW)  # the last instant of the window still replays
    again = await api.post("/v1/payments", PAYMENT, "pay-1")
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    api.clock.advance(timedelta(microseconds=1))
    await expired(api, "/v1/payments", PAYMENT, "pay-1", {**PAYMENT, "amount": 991})
    # A new key is a new payment, as ever.
    assert (await api.post("/v1/payments", PAYMENT, "pay-2")).status_code == 202


async def test_retries_racing_in_one_intake_group_are_judged_by_the_window_too(
    api: Api,
) -> None:
    """Concurrent intents share a commit (engine/group_intake.py): the retries
    among them are judged in that path, not the one-by-one path."""
    await api.post("/v1/payments", PAYMENT, "grouped-old")
    api.clock.advance(WINDOW + timedelta(seconds=1))
    answers = await asyncio.gather(
        api.post("/v1/payments", PAYMENT, "grouped-old"),
        *(api.post("/v1/payments", PAYMENT, f"grouped-new-{i}") for i in range(5)),
    )
    assert answers[0].status_code == 409
    assert answers[0].json()["type"].endswith("/key-expired")
    assert [a.status_code for a in answers[1:]] == [202] * 5


async def test_every_keyed_route_keeps_the_window(api: Api) -> None:
    mandate = await api.post(
        "/v1/mandates", {"currency": "EUR", "max_amount": 5000, "total_limit": 20000}, "md-1"
    )
    assert mandate.status_code == 201, mandate.text
    mandate_id = mandate.json()["id"]
    under = {**PAYMENT, "mandate_id": mandate_id}
    assert (await api.post("/v1/payments", under, "under-1")).status_code == 202
    endpoint = {"url": "http://127.0.0.1:9/hook"}
    created = await api.client.post(
        "/v1/webhook-endpoints",
        json=endpoint,
        headers={**api.auth, "Idempotency-Key": "wh-1"},
    )
    assert created.status_code == 201, created.text
    suspend = await api.post(f"/v1/mandates/{mandate_id}/suspend", {}, "suspend-1")
    assert suspend.status_code == 200, suspend.text

    api.clock.advance(WINDOW + timedelta(hours=1))
    limits = {"currency": "EUR", "max_amount": 5000, "total_limit": 20000}
    await expired(api, "/v1/mandates", limits, "md-1", {**limits, "total_limit": 30000})
    await expired(api, "/v1/payments", under, "under-1", {**under, "amount": 1})
    await expired(api, f"/v1/mandates/{mandate_id}/suspend", {}, "suspend-1")
    await expired(api, "/v1/webhook-endpoints", endpoint, "wh-1", {"url": "http://127.0.0.1:9/b"})


async def test_refunds_and_operator_actions_keep_the_window(api: Api, engine: AsyncEngine) -> None:
    from tests.test_recovery_model import Scene

    scene = Scene(engine)
    scene.clock.now = api.clock.now
    payment = await scene.accept()  # alice's, settled by the simulated provider
    await scene.drain()
    alice = await create_api_key(engine, api.clock, "alice", False)
    api.auth = {"Authorization": f"Bearer {alice}"}
    refund = await api.post(f"/v1/payments/{payment}/refunds", {"amount": 100}, "rf-1")
    assert refund.status_code == 202, refund.text
    stuck = await scene.accept_with_key("stuck")
    scene.provider.submit_behaviour = "lose_before_execute"
    await scene.drain()  # UNKNOWN: escalatable
    escalate = await api.post(
        f"/v1/ops/operations/{stuck}/escalate", {"reason": "looked"}, "esc-1", operator=True
    )
    assert escalate.status_code == 200, escalate.text

    api.clock.advance(WINDOW + timedelta(days=1))
    await expired(api, f"/v1/payments/{payment}/refunds", {"amount": 100}, "rf-1", {"amount": 50})
    before = await api.counts()
    again = await api.post(
        f"/v1/ops/operations/{stuck}/escalate", {"reason": "looked"}, "esc-1", operator=True
    )
    assert again.status_code == 409 and again.json()["type"].endswith("/key-expired")
    assert await api.counts() == before


def test_the_window_is_a_setting_with_a_floor() -> None:
    assert Settings().replay_window == DEFAULT_REPLAY_WINDOW == timedelta(days=30)
    assert Settings(replay_window="7d").replay_window == timedelta(days=7)
    with pytest.raises(ValueError, match="replay_window must be at least 1h"):
        Settings(replay_window="59m")
    assert timedelta(hours=1) == SHORTEST_REPLAY_WINDOW
    # The service has no switch that lowers it (the one it had is gone).
    with pytest.raises(ValueError, match="replay_window must be at least 1h"):
        Settings(replay_window="5m", record_retention="5m", short_retention_for_tests=True)


def test_only_the_tools_build_lowers_the_floor_for_the_soak() -> None:
    """`chaos --retention` starts its fleet through intentledger_tools.short_retention."""
    short = ShortRetentionSettings(replay_window="5m", record_retention="5m")
    assert short.replay_window == short.record_retention == timedelta(minutes=5)
    with pytest.raises(ValueError, match="record_retention must be at least"):
        ShortRetentionSettings(replay_window="5m", record_retention="4m")
    # Even then, never shorter than the chaos client's retries last, nor with a real provider.
    assert timedelta(seconds=CLIENT_PATIENCE_SECONDS) < SHORTEST_TEST_REPLAY_WINDOW
    with pytest.raises(ValueError, match="replay_window must be at least 3m"):
        ShortRetentionSettings(replay_window="2m", record_retention="2m")
    with pytest.raises(ValueError, match="sandbox provider only"):
        ShortRetentionSettings(replay_window="5m", record_retention="5m", provider="stripe")


def test_the_command_refuses_a_short_window_that_the_tools_build_takes(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "INTENTLEDGER_REPLAY_WINDOW": "5m",
        "INTENTLEDGER_RECORD_RETENTION": "5m",
        "INTENTLEDGER_SHORT_RETENTION_FOR_TESTS": "true",
    }
    migrate = ["migrate", "--database-url", f"sqlite:///{tmp_path / 'ledger.db'}"]
    tools_build = [sys.executable, "-m", short_retention.__name__]

    def run(command: list[str], **more_env: str) -> tuple[int, str]:
        done = subprocess.run(
            command, env={**env, **more_env}, capture_output=True, text=True, timeout=120
        )
        return done.returncode, " ".join(done.stderr.split())

    refused, says = run([*INTENTLEDGER, *migrate])
    assert refused == 2 and "replay_window must be at least 1h" in says, says
    taken, says = run([*tools_build, *migrate])
    assert taken == 0, says
    assert (
        "keys expire and records are reaped after 5m" in says and "never for a real ledger" in says
    )
    # Through another of the tools' builds (a mutation run that also reaps).
    taken, says = run([*tools_build, "--run", blind_retry.__name__, *migrate])
    assert taken == 0 and "reaped after 5m" in says, says
    refused, says = run([*tools_build, *migrate], INTENTLEDGER_PROVIDER="stripe")
    assert refused == 2 and "sandbox provider only" in says, says


def test_the_window_is_closed_at_its_end() -> None:
    assert not replay_window_passed(START, START + WINDOW, WINDOW)
    assert replay_window_passed(START, START + WINDOW + timedelta(microseconds=1), WINDOW)
