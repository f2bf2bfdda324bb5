"""What the store reports of the rows it writes: counted and logged only once
the transaction commits (`after_commit`), so a rolled-back or retried unit of
work is neither counted nor announced to on-call."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from intentledger.domain.states import State
from intentledger.observability.metrics import (
    DECISIONS,
    GROUP_COMMIT_SIZE,
    GROUP_RECORDS_REPLANNED,
    LEASE_EXPIRIES,
    RECORD_DELAY_SECONDS,
    SWEEPER_ACTIONS,
    TRANSITIONS,
    after_commit,
)
from intentledger.store.direct import LedgerConnection

log = logging.getLogger("intentledger.ledger")

# A flag is a person's work: every raise is logged as an error.
FLAGS = ("outcome_contradicted", "duplicate_detected")


def _transition_level(before: State | None, after: State) -> int:
    """Loud where a person may have to act; quiet on the happy path, which at a
    thousand payments a second would bury everything else."""
    if after is State.MANUAL_REVIEW:
        return logging.WARNING
    if after is State.UNKNOWN:
        # Becoming UNKNOWN is news; a scheduled check that says "wait again" is not.
        return logging.INFO if before is State.RECONCILIATION_DUE else logging.WARNING
    if after in (State.SUBMITTING, State.RECONCILIATION_DUE) or before in (None, State.SUBMITTING):
        # New intents, sends, scheduled checks, first answers (settled or requeued).
        return logging.DEBUG
    return logging.INFO


def transition(
    conn: LedgerConnection,
    operation_id: str,
    before: State | None,
    after: State,
    next_action: str,
    reason: str,
) -> None:
    after_commit(conn, TRANSITIONS.labels(before or "none", after).inc)
    level = _transition_level(before, after)
    if log.isEnabledFor(level):
        after_commit(
            conn,
            lambda: log.log(
                level,
                "%s: %s -> %s (next: %s): %s",
                operation_id,
                before or "new",
                after,
                next_action,
                reason,
                extra={
                    "operation_id": operation_id,
                    "event": f"operation.{after.lower()}",
                    "from_state": before,
                    "to_state": after,
                    "next_action": next_action,
                },
            ),
        )


def transitions(
    conn: LedgerConnection,
    before: State | None,
    after: State,
    count: int,
    stage: str,
    group_size: int | None = None,
) -> None:
    """A grouped transaction's transitions, all alike, and its size (`count`
    unless given; quiet: these are the happy path's intake, sends and settlements)."""
    after_commit(
        conn, functools.partial(transitions_committed, before, after, count, stage, group_size)
    )


def transitions_committed(
    before: State | None, after: State, count: int, stage: str, group_size: int | None = None
) -> None:
    """`transitions`, for a statement that has already committed itself."""
    if count:
        TRANSITIONS.labels(before or "none", after).inc(count)
    size = count if group_size is None else group_size
    if size:
        GROUP_COMMIT_SIZE.labels(stage).observe(size)


def flags_raised(conn: LedgerConnection, operation: Any, fields: Mapping[str, Any]) -> None:
    for flag in FLAGS:
        if fields.get(flag) and not getattr(operation, flag):
            after_commit(conn, functools.partial(_flag_raised, operation.operation_id, flag))


def _flag_raised(operation_id: str, flag: str) -> None:
    log.error(
        "%s: %s raised: a person must look (next: operator)",
        operation_id,
        flag,
        extra={"operation_id": operation_id, "event": f"flag.{flag}"},
    )


def _lease_expired(row: Any) -> None:
    log.warning(
        "%s: outbox row %s (%s) claimed again after a lease ran out (delivery %s)",
        row.operation_id,
        row.id,
        row.kind,
        row.deliveries,
        extra={"operation_id": row.operation_id, "event": "lease.expired"},
    )


def decision(conn: LedgerConnection, values: Mapping[str, Any]) -> None:
    rule = str(values["rule"])
    after_commit(conn, DECISIONS.labels(rule).inc)
    source = str(values.get("source", ""))
    by_operator = source.startswith("operator:")
    operation_id = values.get("operation_id")
    after_commit(
        conn,
        lambda: log.log(
            logging.WARNING if by_operator else logging.INFO,
            "%s: decision %s by %s (next: %s): %s",
            operation_id,
            rule,
            source,
            values.get("next_action"),
            values.get("reason"),
            extra={
                "operation_id": operation_id,
                "event": "operator.action" if by_operator else "decision",
                "rule": rule,
                "source": source,
            },
        ),
    )


def claimed(conn: LedgerConnection, rows: Sequence[Any]) -> None:
    """Rows claimed again after an earlier holder's lease ran out (a claim counts
    each delivery: more than one means someone held it before and did not finish)."""
    for row in rows:
        if row.deliveries > 1:
            after_commit(conn, LEASE_EXPIRIES.labels("outbox").inc)
            after_commit(conn, functools.partial(_lease_expired, row))


def swept(conn: LedgerConnection, operation_id: str, attempt: int) -> None:
    after_commit(conn, SWEEPER_ACTIONS.labels("stale_submitting_to_unknown").inc)
    after_commit(
        conn,
        lambda: log.warning(
            "%s: sweeper made stale SUBMITTING UNKNOWN (attempt %s); not sending again",
            operation_id,
            attempt,
            extra={"operation_id": operation_id, "attempt": attempt, "event": "sweep"},
        ),
    )


def group_replanned() -> None:
    """A group record found an operation moved on since its pre-submit: its
    transaction rolled back, and the group is planned again under locks."""
    GROUP_RECORDS_REPLANNED.inc()


def answers_recorded(kind: str, recorded_by: str, answered: Sequence[float]) -> None:
    """Provider answers (each `time.monotonic()` at its arrival) whose outcome's
    transaction has just returned from its commit: called after the commit, not
    at it, so the delay counts the commit's own round trip and flush."""
    now = time.monotonic()
    observe = RECORD_DELAY_SECONDS.labels(kind, recorded_by).observe
    for at in answered:
        observe(now - at)
