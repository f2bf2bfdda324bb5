"""Mandates: standing authorisations whose payments reserve money at intake.

The mandate's row lock orders everything that touches its money: intake
reserves under it, the dispatcher takes it before the operation lock and before
SUBMITTING, and suspension or revocation takes it to cancel every payment not
yet submitted. A committed SUBMITTING is the linearisation point: a suspension
that commits after it does not touch that payment.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.mandates import (
    Books,
    MandateStatus,
    cancels_unsubmitted,
    reserve_refusal,
    status_after,
)
from intentledger.domain.mandates import MandateAction as MandateAction  # the API's name for it
from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW
from intentledger.domain.states import NextAction, State
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.refusal import Refusal, claim_key, find_keyed_replay, retry_key_races
from intentledger.store.ledger import Ledger
from intentledger.store.records import MandateRecord

CREATE_ROUTE = "POST /v1/mandates"


class MandateRefusal(Refusal):
    """A request the mandate does not allow; nothing is written for it."""


@dataclass(frozen=True)
class Keyed:
    actor: str
    route: str
    idempotency_key: str
    request_hash: str
    # How long an equal retry of this key replays (decision 0018).
    replay_window: timedelta = DEFAULT_REPLAY_WINDOW


def new_mandate_id() -> str:
    return "md_" + secrets.token_hex(12)


async def _replay(ledger: Ledger, keyed: Keyed, now: datetime) -> str | None:
    return await find_keyed_replay(ledger, keyed, now)


async def create_mandate(
    engine: AsyncEngine, clock: Clock, keyed: Keyed, body: dict[str, Any]
) -> tuple[MandateRecord, bool]:
    async def attempt() -> tuple[MandateRecord, bool]:
        async with engine.begin() as conn:
            ledger = Ledger(conn)
            now = clock()
            replayed = await _replay(ledger, keyed, now)
            if replayed is not None:
                return await _mandate(ledger, replayed), True
            mandate_id = new_mandate_id()
            await _claim(ledger, keyed, mandate_id, now)
            await ledger.insert_mandate(
                mandate_id=mandate_id,
                actor=keyed.actor,
                currency=body["currency"],
                max_amount=body["max_amount"],
                total_limit=body["total_limit"],
                reserved=0,
                spent=0,
                status=MandateStatus.ACTIVE,
                version=1,
                created_at=now,
                updated_at=now,
            )
            return await _mandate(ledger, mandate_id), False

    return await retry_key_races(attempt)


async def _mandate(ledger: Ledger, mandate_id: str) -> MandateRecord:
    mandate = await ledger.get_mandate(mandate_id)
    assert mandate is not None
    return mandate


async def _claim(ledger: Ledger, keyed: Keyed, mandate_id: str, now: datetime) -> None:
    await claim_key(
        ledger,
        keyed.actor,
        keyed.route,
        keyed.idempotency_key,
        keyed.request_hash,
        mandate_id,
        now,
    )


async def reserve_for_payment(
    ledger: Ledger, actor: str, mandate_id: str, amount: int, currency: str, now: datetime
) -> None:
    """Inside the intake transaction: lock the mandate, check, and hold the amount."""
    mandate = await ledger.lock_mandate(mandate_id)
    if mandate is None or mandate.actor != actor:
        raise MandateRefusal(422, "mandate-not-found", f"no mandate {mandate_id!r} for this actor")
    books = Books(
        mandate.currency, mandate.max_amount, mandate.total_limit, mandate.reserved, mandate.spent
    )
    refused = reserve_refusal(mandate_id, mandate.status, books, amount, currency)
    if refused is not None:
        raise MandateRefusal(refused.status, refused.code, refused.detail)
    await changes.change_mandate(ledger, mandate_id, now, reserved=mandate.reserved + amount)


async def cancel_unsubmitted(
    ledger: Ledger, mandate_id: str, now: datetime, reason: str, source: str
) -> int:
    """Cancel every ACCEPTED payment under a locked mandate (reservations released)."""
    cancelled = 0
    for operation in await ledger.accepted_under_mandate(mandate_id):
        await changes.transition(
            ledger,
            operation,
            State.CANCELLED,
            now=now,
            next_action=NextAction.NONE,
            reason=reason,
            source=source,
            retry_after_at=None,
        )
        await ledger.finish_pending_outbox(operation.operation_id, now)
        cancelled += 1
    return cancelled


async def change_status(
    engine: AsyncEngine, clock: Clock, keyed: Keyed, mandate_id: str, action: MandateAction
) -> tuple[MandateRecord, bool]:
    async def attempt() -> tuple[MandateRecord, bool]:
        async with engine.begin() as conn:
            ledger = Ledger(conn)
            now = clock()
            replayed = await _replay(ledger, keyed, now)
            if replayed is not None:
                return await _mandate(ledger, replayed), True
            await _claim(ledger, keyed, mandate_id, now)
            mandate = await ledger.lock_mandate(mandate_id)
            if mandate is None or mandate.actor != keyed.actor:
                raise MandateRefusal(404, "mandate-not-found", f"no mandate {mandate_id!r}")
            target = status_after(action, mandate.status)
            if target is None:
                raise MandateRefusal(
                    409,
                    "mandate-state",
                    f"cannot {action} mandate {mandate_id}: it is {mandate.status}",
                )
            if cancels_unsubmitted(target):
                await cancel_unsubmitted(
                    ledger,
                    mandate_id,
                    now,
                    f"mandate {mandate_id} {target} before submission",
                    f"api:{keyed.actor}",
                )
            await changes.change_mandate(ledger, mandate_id, now, status=target)
            return await _mandate(ledger, mandate_id), False

    return await retry_key_races(attempt)


async def read_mandate(engine: AsyncEngine, actor: str, mandate_id: str) -> MandateRecord | None:
    async with engine.connect() as conn:
        mandate = await Ledger(conn).get_mandate(mandate_id)
    return mandate if mandate is not None and mandate.actor == actor else None
