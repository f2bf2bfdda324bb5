"""Entering UNKNOWN: the one way an operation starts waiting for evidence.

Whoever finds an outcome unknown (a lost answer, a resumed delivery, the
sweeper, a lookup that says "still processing") records the transition and
schedules the next look in the same transaction, so no UNKNOWN operation is
ever left without a due check.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from intentledger.domain.states import NextAction, State
from intentledger.engine import changes
from intentledger.store.records import OperationRecord


def plan_unknown(
    planned: changes.Writes,
    operation: OperationRecord,
    *,
    check_at: datetime,
    reason: str,
    source: str,
    **fields: Any,
) -> None:
    now = planned.now
    planned.change(
        changes.plan(
            operation,
            State.UNKNOWN,
            now=now,
            next_action=NextAction.RECONCILE,
            # The append-only trail keeps when the next look was scheduled for;
            # retry_after_at on the record is overwritten by later checks.
            reason=f"{reason}; next check at {check_at.isoformat()}",
            source=source,
            last_observed_at=now,
            retry_after_at=check_at,
            **fields,
        )
    )
    planned.enqueue(operation, "reconcile", check_at)
