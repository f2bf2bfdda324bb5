"""A suspension racing dispatchers over a mandate's queued payments, many times.

Linearisation: the mandate lock orders the suspension against every
pre-submit transaction, so each payment either committed SUBMITTING before the
suspension (and may reach the provider) or is cancelled by the suspension
itself (and never does). Money held always equals the sums over operations.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from datetime import UTC, datetime

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.engine import mandates
from intentledger.engine.intake import Intent, accept
from intentledger.store.tables import mandates as mandates_table
from intentledger.store.tables import operations, transitions
from tests.test_dispatch import make_worker

ROUTE = "POST /v1/payments"
PAYMENTS_PER_TRIAL = 5


def clock() -> datetime:
    return datetime.now(UTC)


async def queue_payments(engine: AsyncEngine, mandate_id: str, trial: int) -> list[str]:
    ids = []
    for n in range(PAYMENTS_PER_TRIAL):
        body = {
            "amount": 10 + n,
            "currency": "EUR",
            "payment_method": "pm_ok",
            "metadata": {},
            "mandate_id": mandate_id,
        }
        intent = Intent(
            "racer", ROUTE, f"t{trial}-p{n}", request_hash("racer", ROUTE, body), body, "sandbox"
        )
        ids.append(str((await accept(engine, clock, intent)).operation["operation_id"]))
    return ids


async def check_books(engine: AsyncEngine, mandate_id: str) -> None:
    async with engine.connect() as conn:
        md = (
            await conn.execute(
                select(mandates_table).where(mandates_table.c.mandate_id == mandate_id)
            )
        ).one()
        ops = (
            await conn.execute(select(operations).where(operations.c.mandate_id == mandate_id))
        ).all()
    held = sum(o.amount for o in ops if o.state not in ("OUTCOME_KNOWN", "CANCELLED"))
    spent = sum(o.amount for o in ops if o.outcome == "succeeded")
    assert (md.reserved, md.spent) == (held, spent)


async def trial(engine: AsyncEngine, sandbox: str, number: int, rng: random.Random) -> Counter[str]:
    keyed = mandates.Keyed("racer", mandates.CREATE_ROUTE, f"md-{number}", f"h{number}")
    mandate, _ = await mandates.create_mandate(
        engine, clock, keyed, {"currency": "EUR", "max_amount": 100, "total_limit": 10_000}
    )
    mandate_id = mandate.mandate_id
    ids = await queue_payments(engine, mandate_id, number)
    await check_books(engine, mandate_id)
    workers = [make_worker(engine, sandbox, clock, worker=f"w{number}-{i}") for i in range(2)]

    async def dispatch(worker_index: int) -> None:
        # One dispatcher claims in batches, the other one row at a time: the two
        # paths take their locks in the same order, or this would deadlock.
        await asyncio.sleep(rng.random() * 0.01)
        worker = workers[worker_index]
        while await (worker.deliver_batch(limit=3) if worker_index == 0 else worker.deliver_next()):
            pass

    async def suspend() -> datetime:
        await asyncio.sleep(rng.random() * 0.02)
        change = mandates.Keyed("racer", "POST /v1/mandates/{id}/suspend", f"s-{number}", "h")
        await mandates.change_status(engine, clock, change, mandate_id, "suspend")
        return clock()

    *_, suspended_after = await asyncio.gather(dispatch(0), dispatch(1), suspend())
    for worker in workers:
        await worker.drain()
        await worker.close()

    async with engine.connect() as conn:
        ops = {
            o.operation_id: o
            for o in (
                await conn.execute(select(operations).where(operations.c.mandate_id == mandate_id))
            )
        }
        moves = (
            await conn.execute(select(transitions).where(transitions.c.operation_id.in_(ids)))
        ).all()
    submitted = {t.operation_id for t in moves if t.to_state == "SUBMITTING"}
    cancelled_by = {t.operation_id: t.source for t in moves if t.to_state == "CANCELLED"}
    reached = {r["reference"] for r in httpx.get(f"{sandbox}/requests").json()["data"]}
    outcome: Counter[str] = Counter()
    for op_id in ids:
        op = ops[op_id]
        if op_id in submitted:
            # It committed SUBMITTING before the suspension did: the suspension left it alone.
            assert op_id not in cancelled_by and op.state == "OUTCOME_KNOWN"
            outcome["submitted"] += 1
        else:
            # ACCEPTED when the suspension committed: cancelled by the suspension itself.
            assert op.state == "CANCELLED" and cancelled_by[op_id] == "api:racer"
            assert op_id not in reached
            outcome["cancelled"] += 1
    assert reached & set(ids) == submitted
    assert max((t.at for t in moves if t.to_state == "SUBMITTING"), default=None) is None or all(
        t.at <= suspended_after for t in moves if t.to_state == "SUBMITTING"
    )
    await check_books(engine, mandate_id)
    return outcome


async def test_suspension_races_dispatchers(
    engine: AsyncEngine, backend: str, sandbox: str
) -> None:
    rng = random.Random(20261130)
    trials = 200 if backend == "postgresql" else 25
    totals: Counter[str] = Counter()
    for number in range(trials):
        totals += await trial(engine, sandbox, number, rng)
    # The race was real: both sides won some payments.
    assert totals["submitted"] > 0 and totals["cancelled"] > 0, totals
