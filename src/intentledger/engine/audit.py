"""Duplicate audit: after a new-key request, did both attempts execute?

Only an operator-approved (or rule-allowed) request with a new provider key can
execute twice. When such an operation settles, one more lookup is scheduled to
count the executed charges under its reference; two or more are flagged on the
record for a refund, never hidden.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from intentledger.store.ledger import Ledger

AUDIT_ATTEMPTS = 10


async def schedule_duplicate_audit(
    ledger: Ledger, operation_id: str, now: datetime, delay: timedelta
) -> None:
    if len(await ledger.distinct_keys(operation_id)) > 1:
        await ledger.enqueue(operation_id, "audit", now + delay, now)
