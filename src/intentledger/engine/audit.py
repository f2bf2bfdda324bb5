"""Settling an operation, and the duplicate audit that follows a new-key request.

Every path that makes an outcome known (a provider's answer, a lookup, an
operator) goes through `settle`, so each one also schedules the audit when the
operation ever used more than one provider key: only then can it have executed
twice. Two or more executed charges are flagged on the record for a refund,
never hidden.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from intentledger.domain.states import NextAction, Outcome, State
from intentledger.store.ledger import Ledger
from intentledger.store.tables import Record

AUDIT_ATTEMPTS = 10


async def schedule_duplicate_audit(
    ledger: Ledger, operation_id: str, now: datetime, delay: timedelta
) -> None:
    if len(await ledger.distinct_keys(operation_id)) > 1:
        await ledger.enqueue(operation_id, "audit", now + delay, now)


async def settle(
    ledger: Ledger,
    operation: Record,
    outcome: Outcome,
    *,
    now: datetime,
    reason: str,
    source: str,
    audit_after: timedelta,
    **fields: Any,
) -> None:
    """OUTCOME_KNOWN with `outcome`, then the duplicate audit if one is due."""
    await ledger.transition(
        operation,
        State.OUTCOME_KNOWN,
        now=now,
        next_action=NextAction.NONE,
        reason=reason,
        source=source,
        outcome=outcome,
        last_observed_at=now,
        retry_after_at=None,
        **fields,
    )
    await schedule_duplicate_audit(ledger, operation.operation_id, now, audit_after)
