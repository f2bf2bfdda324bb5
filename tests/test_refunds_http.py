"""Refunds against the real sandbox over loopback, and over the real API, on
both databases (issue 16's Must show)."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.app import create_app
from intentledger.domain.canonical import request_hash
from intentledger.domain.retention import sandbox_policy
from intentledger.engine.api_keys import create_api_key
from intentledger.engine.clock import system_clock
from intentledger.engine.intake import Intent
from intentledger.engine.operator import (
    ActionNotAllowed,
    OperatorAction,
    approve_resubmission,
    perform,
)
from intentledger.engine.refunds import REFUND_ROUTE, accept_refund, refund_duplicate
from intentledger.store.tables import decisions
from tests.served import Served
from tests.test_dispatch import MovableClock, accept, make_worker, operation, rows
from tests.test_recovery import attempts, run_checks


def sandbox_refunds(sandbox: str, reference: str | None = None, **params: str) -> list[Any]:
    if reference is not None:
        params["reference"] = reference
    data: list[Any] = httpx.get(f"{sandbox}/refunds", params=params).json()["data"]
    return data


async def refund_in_sandbox(
    engine: AsyncEngine, clock: MovableClock, payment_id: str, scenario: str, amount: int
) -> str:
    body = {"payment_id": payment_id, "amount": amount, "sandbox_scenario": scenario}
    intent = Intent(
        "alice",
        REFUND_ROUTE,
        f"refund-{secrets.token_hex(4)}",
        request_hash("alice", REFUND_ROUTE, body),
        body,
        "sandbox",
        "refund",
    )
    made = (await accept_refund(engine, clock, intent, payment_id)).operation
    return str(made["operation_id"] if isinstance(made, dict) else made.operation_id)


async def test_a_refund_whose_answer_is_lost_after_execution_is_reconciled_not_resent(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    worker = make_worker(engine, sandbox, clock, timeout=0.5)
    payment = await accept(engine, clock, "pm_ok")
    await worker.drain()
    charge = (await operation(engine, payment)).provider_reference
    op_id = await refund_in_sandbox(engine, clock, payment, "timeout_after_execute", 300)
    await worker.drain()
    assert (await operation(engine, op_id)).state == "UNKNOWN"
    await run_checks(worker, clock, timedelta(seconds=31), 1)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome, op.reconciliation_status) == (
        "OUTCOME_KNOWN",
        "succeeded",
        "found_succeeded",
    )
    [at_provider] = sandbox_refunds(sandbox, op_id)
    assert (at_provider["charge"], at_provider["amount"]) == (charge, 300)
    assert op.provider_reference == at_provider["id"]
    assert len(await attempts(engine, op_id)) == 1, "found, not sent again"


async def test_a_refund_lost_before_execution_is_sent_again_with_the_same_key(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    worker = make_worker(engine, sandbox, clock, timeout=0.5)
    payment = await accept(engine, clock, "pm_ok")
    await worker.drain()
    op_id = await refund_in_sandbox(engine, clock, payment, "timeout_before_execute", 500)
    await run_checks(worker, clock, timedelta(seconds=31), 1)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome) == ("OUTCOME_KNOWN", "succeeded")
    first, second = await attempts(engine, op_id)
    assert second.provider_idempotency_key == first.provider_idempotency_key
    [decision] = await rows(engine, decisions, op_id)
    assert decision.rule == "replay_within_retention"
    assert len(sandbox_refunds(sandbox, op_id)) == 1


# -- over the real API ------------------------------------------------------------------------


def pay_and_settle(served: Served, amount: int) -> str:
    response = httpx.post(
        f"{served.url}/v1/payments",
        json={"amount": amount, "currency": "EUR", "payment_method": "pm_ok"},
        headers={**served.auth, "Idempotency-Key": secrets.token_hex(8)},
    )
    assert response.status_code == 202, response.text
    payment = str(response.json()["id"])
    served.settle(payment, {"OUTCOME_KNOWN"})
    return payment


async def test_fifty_concurrent_refunds_of_ten_against_a_hundred_accept_exactly_ten(
    served: Served,
) -> None:
    payment = pay_and_settle(served, 100)
    async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:

        async def ask(i: int) -> httpx.Response:
            return await client.post(
                f"/v1/payments/{payment}/refunds",
                json={"amount": 10},
                headers={**served.auth, "Idempotency-Key": f"fifty-{i}"},
            )

        answers = await asyncio.gather(*(ask(i) for i in range(50)))
    statuses = Counter(a.status_code for a in answers)
    assert statuses == {202: 10, 422: 40}, statuses
    refused = {a.json()["type"].rsplit("/", 1)[-1] for a in answers if a.status_code == 422}
    assert refused <= {"refund-exceeds-refundable", "nothing-to-refund"}
    accepted = [a.json()["id"] for a in answers if a.status_code == 202]
    for op_id in accepted:
        served.settle(op_id, {"OUTCOME_KNOWN"})
    charge = served.operation(payment)["provider_reference"]
    at_provider = httpx.get(f"{served.url}/_sandbox/refunds", params={"charge": charge}).json()
    assert sum(r["amount"] for r in at_provider["data"]) == 100
    listed = httpx.get(f"{served.url}/v1/payments/{payment}/refunds", headers=served.auth)
    assert sorted(r["id"] for r in listed.json()["data"]) == sorted(accepted)
    shown = served.operation(payment)
    assert (shown["amount_refunded"], shown["amount_refundable"]) == (100, 0)


# -- refusals, in process: each changes nothing ------------------------------------------------


@pytest.fixture
async def api(engine: AsyncEngine) -> Any:
    token = await create_api_key(engine, system_clock, "ivy", False)
    app = create_app(engine, system_clock, "sandbox")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, {"Authorization": f"Bearer {token}"}


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"amount": 0}, 422),
        ({"amount": -5}, 422),
        ({"amount": "10"}, 422),
        ({"amount": 10.5}, 422),  # 10.0 is the integer 10 (JSON Schema), 10.5 is not
        ({"amount": 10, "currency": "EUR"}, 422),
        ({"reason": ""}, 422),
        ({"reason": "x" * 501}, 422),
        ({"sandbox_scenario": "explode"}, 422),
        ([10], 422),
        ({"reason": "\u0000"}, 400),
    ],
)
async def test_bad_refund_bodies_are_refused(api: Any, body: Any, status: int) -> None:
    client, auth = api
    response = await client.post(
        "/v1/payments/op_000000000000000000000000/refunds",
        json=body,
        headers={**auth, "Idempotency-Key": "r1"},
    )
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"


async def test_a_missing_payment_and_a_missing_key_are_refused(api: Any) -> None:
    client, auth = api
    missing = await client.post(
        "/v1/payments/op_000000000000000000000000/refunds",
        json={},
        headers={**auth, "Idempotency-Key": "r1"},
    )
    assert missing.status_code == 404, missing.text
    no_key = await client.post(
        "/v1/payments/op_000000000000000000000000/refunds", json={}, headers=auth
    )
    assert no_key.status_code == 400
    listed = await client.get("/v1/payments/op_000000000000000000000000/refunds", headers=auth)
    assert listed.status_code == 404


# -- remedying a duplicate ----------------------------------------------------------------------


async def test_refund_duplicate_refunds_the_extra_charge_once_and_never_the_settled_one(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    payment = await accept(engine, clock, "pm_lookup_lag")
    worker = make_worker(engine, sandbox, clock, timeout=0.5, retention=timedelta(minutes=1))
    await worker.drain()  # executed; the answer is lost
    clock.advance(timedelta(seconds=60))
    await worker.drain()  # the lookup lags: not found, and the key is too old to replay
    approve = OperatorAction(payment, "olive", "dashboard search showed nothing")
    await perform(
        engine,
        clock,
        lambda ledger, now: approve_resubmission(
            ledger, now, approve, lambda _p: sandbox_policy(timedelta(hours=24))
        ),
    )
    await worker.drain()  # the new-key request executes a second time
    await asyncio.sleep(3.1)  # the sandbox's lookup lag passes
    clock.advance(timedelta(seconds=31))
    await worker.drain()  # the audit counts both charges
    flagged = await operation(engine, payment)
    assert flagged.duplicate_detected
    settled_charge = flagged.provider_reference
    [extra] = [c for c in flagged.executed_references if c != settled_charge]

    def remedy(charge: str) -> Any:
        action = OperatorAction(payment, "olive", "the customer was charged twice")
        return lambda ledger, now: refund_duplicate(ledger, now, action, charge)

    with pytest.raises(ActionNotAllowed, match="settled"):
        await perform(engine, clock, remedy(settled_charge))
    with pytest.raises(ActionNotAllowed, match="not an executed charge"):
        await perform(engine, clock, remedy("ch_nobody"))
    done, _ = await perform(engine, clock, remedy(extra))
    assert done.startswith("refund op_")
    with pytest.raises(ActionNotAllowed, match="in flight"):
        await perform(engine, clock, remedy(extra))  # a second remedy of the same charge
    await worker.drain()

    [refund] = sandbox_refunds(sandbox, charge=extra)
    assert refund["amount"] == 500
    assert sandbox_refunds(sandbox, charge=settled_charge) == [], "the settled charge is untouched"
    cleared = await operation(engine, payment)
    assert not cleared.duplicate_detected and cleared.next_action == "none"
    rules = [d.rule for d in await rows(engine, decisions, payment)]
    assert rules[-2:] == ["operator_refund_duplicate", "duplicate_refunded"]
    [asked] = [d for d in await rows(engine, decisions, payment) if d.rule.endswith("duplicate")]
    assert (asked.inputs["by"], asked.inputs["charge"]) == ("olive", extra)


async def test_the_same_key_with_another_body_is_a_conflict_and_an_equal_retry_replays(
    engine: AsyncEngine,
) -> None:
    from tests.test_recovery_model import Scene

    scene = Scene(engine)
    payment = await scene.accept()  # alice's
    await scene.drain()
    token = await create_api_key(engine, system_clock, "alice", False)
    app = create_app(engine, scene.clock, "sandbox")
    auth = {"Authorization": f"Bearer {token}", "Idempotency-Key": "same-key"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        path = f"/v1/payments/{payment}/refunds"
        first = await client.post(path, json={"amount": 100}, headers=auth)
        assert first.status_code == 202, first.text
        again = await client.post(path, json={"amount": 100}, headers=auth)
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert again.headers["idempotent-replayed"] == "true"
        other = await client.post(path, json={"amount": 101}, headers=auth)
        assert other.status_code == 409, other.text
        # The key names one request: the same body for another payment is another request.
        other_payment = await scene.accept_with_key("second")
        await scene.drain()
        elsewhere = await client.post(
            f"/v1/payments/{other_payment}/refunds", json={"amount": 100}, headers=auth
        )
        assert elsewhere.status_code == 409, elsewhere.text
        listed = await client.get(path, headers={"Authorization": auth["Authorization"]})
        assert [r["id"] for r in listed.json()["data"]] == [first.json()["id"]]


async def test_refund_duplicate_over_the_api_needs_the_operator_role_and_a_flag(
    engine: AsyncEngine,
) -> None:
    from tests.test_recovery_model import Scene

    scene = Scene(engine)
    payment = await scene.accept()
    await scene.drain()
    operator_token = await create_api_key(engine, system_clock, "olive", True)
    merchant_token = await create_api_key(engine, system_clock, "alice", False)
    app = create_app(engine, scene.clock, "sandbox")
    path = f"/v1/ops/operations/{payment}/refund-duplicate"
    body = {"charge": "ch_9999", "reason": "charged twice"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        merchant = await client.post(
            path,
            json=body,
            headers={"Authorization": f"Bearer {merchant_token}", "Idempotency-Key": "d-1"},
        )
        assert merchant.status_code == 403
        operator = {"Authorization": f"Bearer {operator_token}", "Idempotency-Key": "d-2"}
        not_flagged = await client.post(path, json=body, headers=operator)
        assert not_flagged.status_code == 409, not_flagged.text
        assert "not flagged" in not_flagged.json()["detail"]
        bad = await client.post(path, json={"charge": "", "reason": "x"}, headers=operator)
        assert bad.status_code == 422


async def test_a_payment_made_through_another_provider_is_not_refunded_here(
    engine: AsyncEngine,
) -> None:
    from tests.test_recovery_model import Scene

    scene = Scene(engine)
    payment = await scene.accept()  # through the sandbox
    await scene.drain()
    token = await create_api_key(engine, system_clock, "alice", False)
    app = create_app(engine, scene.clock, "stripe", provider_kinds=frozenset({"payment", "refund"}))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post(
            f"/v1/payments/{payment}/refunds",
            json={},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "r-1"},
        )
    assert response.status_code == 422, response.text
    assert response.json()["type"].endswith("/provider-mismatch")
