"""Money held stays held: reservations follow outcomes, whoever settles them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.evidence import AUDIT_LOOKS
from intentledger.domain.safety import SafetyRules
from intentledger.domain.states import Outcome
from intentledger.engine import mandates
from intentledger.engine.intake import Intent, accept
from intentledger.engine.operator import OperatorAction, perform, resolve
from intentledger.store.ledger import Ledger
from tests.test_dispatch import MovableClock, make_worker, operation

ROUTE = "POST /v1/payments"


async def pay(engine: AsyncEngine, clock: Any, mandate_id: str, method: str, amount: int) -> str:
    body = {
        "amount": amount,
        "currency": "EUR",
        "payment_method": method,
        "metadata": {},
        "mandate_id": mandate_id,
    }
    intent = Intent("ana", ROUTE, f"k-{method}", request_hash("ana", ROUTE, body), body, "sandbox")
    return str((await accept(engine, clock, intent)).operation["operation_id"])


async def books(engine: AsyncEngine, mandate_id: str) -> tuple[int, int]:
    async with engine.connect() as conn:
        md = await Ledger(conn).get_mandate(mandate_id)
    assert md is not None
    return md.reserved, md.spent


async def test_reservations_follow_outcomes(engine: AsyncEngine, sandbox: str) -> None:
    clock = MovableClock()
    keyed = mandates.Keyed("ana", mandates.CREATE_ROUTE, "md", "h")
    md, _ = await mandates.create_mandate(
        engine, clock, keyed, {"currency": "EUR", "max_amount": 1000, "total_limit": 10_000}
    )
    ok = await pay(engine, clock, md.mandate_id, "pm_ok", 100)
    declined = await pay(engine, clock, md.mandate_id, "pm_declined", 200)
    lost = await pay(engine, clock, md.mandate_id, "pm_timeout_after_execute", 400)
    hole = await pay(engine, clock, md.mandate_id, "pm_blackhole", 800)
    assert await books(engine, md.mandate_id) == (1500, 0)

    worker = make_worker(engine, sandbox, clock, timeout=0.3, rules=SafetyRules(max_checks=1))
    await worker.drain()
    assert (await operation(engine, lost)).state == "UNKNOWN"
    # Success is spent, the decline released, the unknowns still held.
    assert await books(engine, md.mandate_id) == (1200, 100)

    clock.advance(timedelta(seconds=31))
    await worker.drain()
    assert (await operation(engine, lost)).outcome == "succeeded"
    assert (await operation(engine, hole)).state == "MANUAL_REVIEW"
    assert await books(engine, md.mandate_id) == (800, 500)  # held while a person decides

    action = OperatorAction(hole, "olive", "provider confirms nothing was charged")
    await perform(engine, clock, lambda ledger, now: resolve(ledger, now, action, Outcome.FAILED))
    # A person's "failed" frees nothing until the verification looks find the
    # provider quiet (docs/architecture.md, "What money is held"): this black
    # hole never answers a lookup, so past the budget of looks a person is told
    # (provider_not_final), the amount stays held and the looks go on.
    assert await books(engine, md.mandate_id) == (800, 500)
    for _ in range(AUDIT_LOOKS + 1):
        clock.advance(timedelta(hours=7))
        await worker.drain()
    watched = await operation(engine, hole)
    assert (watched.watch, watched.next_action) == ("provider_not_final", "operator")
    assert await books(engine, md.mandate_id) == (800, 500)
    assert (await operation(engine, ok)).outcome == "succeeded"
    assert (await operation(engine, declined)).outcome == "failed"
