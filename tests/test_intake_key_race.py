"""A request that finds its key claimed by a transaction still in flight waits for it:
a replay if that one commits, the key's first use if it rolls back."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.clock import system_clock
from intentledger.engine.intake import IntakeResult, Intent, accept
from intentledger.engine.refusal import Refusal
from intentledger.store.ledger import Ledger
from intentledger.store.tables import idempotency_records, operations

BODY = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}


def intent(request_hash: str = "h" * 64) -> Intent:
    return Intent(
        actor="alice",
        route="POST /v1/payments",
        idempotency_key="raced",
        request_hash=request_hash,
        body=BODY,
        provider="sandbox",
    )


async def _first_holds_the_key(
    engine: AsyncEngine, refuse: bool
) -> tuple[asyncio.Task[IntakeResult], asyncio.Event]:
    """Start an intake that claims the key, then waits inside its transaction."""
    claimed, release = asyncio.Event(), asyncio.Event()

    async def prepare(_ledger: Ledger, _now: datetime, _values: dict[str, Any]) -> None:
        claimed.set()
        await release.wait()
        if refuse:
            raise Refusal(422, "refused", "refused on purpose")

    first = asyncio.create_task(accept(engine, system_clock, intent(), prepare=prepare))
    await asyncio.wait_for(claimed.wait(), 10)
    return first, release


async def _counts(engine: AsyncEngine) -> tuple[int, int]:
    async with engine.connect() as conn:
        ops = (await conn.execute(select(func.count()).select_from(operations))).scalar_one()
        keys = (
            await conn.execute(select(func.count()).select_from(idempotency_records))
        ).scalar_one()
    return ops, keys


async def test_an_equal_request_waits_for_the_claim_and_replays(engine: AsyncEngine) -> None:
    first, release = await _first_holds_the_key(engine, refuse=False)
    second = asyncio.create_task(accept(engine, system_clock, intent()))
    await asyncio.sleep(0.3)
    assert not second.done(), "the second request waits for the first one's key"
    release.set()
    made, replayed = await first, await asyncio.wait_for(second, 10)
    assert not made.replayed and replayed.replayed
    assert replayed.operation.operation_id == made.operation["operation_id"]  # type: ignore[union-attr,index]
    assert await _counts(engine) == (1, 1)


@pytest.mark.parametrize("request_hash", ["h" * 64, "other" + "h" * 59])
async def test_a_request_waiting_for_a_claim_that_rolls_back_gets_the_key(
    engine: AsyncEngine, request_hash: str
) -> None:
    first, release = await _first_holds_the_key(engine, refuse=True)
    second = asyncio.create_task(accept(engine, system_clock, intent(request_hash)))
    await asyncio.sleep(0.3)
    assert not second.done()
    release.set()
    with pytest.raises(Refusal):
        await first
    result = await asyncio.wait_for(second, 10)
    assert not result.replayed
    assert await _counts(engine) == (1, 1)
