"""The reads a chaos run's judge makes of the whole ledger (the conformance
kit's and `intentledger chaos`'s, intentledger.testing.truth): every
operation, and what was decided and resubmitted about them. Test and tool
reads, never the service's: they read every row, unbounded."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Row, select
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.tables import attempts, decisions, operations, transitions


@dataclass(frozen=True)
class WholeLedger:
    operations: dict[str, Row[Any]]  # every operation, by id
    later_attempts: Sequence[Row[Any]]  # every attempt after an operation's first
    # Per operation, the decisions recorded under the given rules.
    decided_under: Counter[str]
    last_rule: dict[str, str]  # per operation, its latest decision's rule
    # The operations a person was asked about (MANUAL_REVIEW) or acted on.
    asked_a_person: set[str]
    # How many operations were ever UNKNOWN.
    went_unknown: int


def read_whole_ledger(conn: Connection, rules: Sequence[str]) -> WholeLedger:
    chosen = select(decisions.c.operation_id).where(decisions.c.rule.in_(rules))
    latest = select(decisions.c.operation_id, decisions.c.rule).order_by(decisions.c.id)
    to_review = (
        select(transitions.c.operation_id)
        .where(transitions.c.to_state == "MANUAL_REVIEW")
        .distinct()
    )
    unknown = select(transitions.c.operation_id).where(transitions.c.to_state == "UNKNOWN")
    by_operator = (
        select(decisions.c.operation_id).where(decisions.c.rule.like("operator%")).distinct()
    )
    return WholeLedger(
        operations={row.operation_id: row for row in conn.execute(select(operations))},
        later_attempts=conn.execute(select(attempts).where(attempts.c.number > 1)).all(),
        decided_under=Counter(row.operation_id for row in conn.execute(chosen)),
        last_rule={row.operation_id: row.rule for row in conn.execute(latest)},
        asked_a_person={row.operation_id for row in conn.execute(to_review)}
        | {row.operation_id for row in conn.execute(by_operator)},
        went_unknown=len({row.operation_id for row in conn.execute(unknown)}),
    )


async def operation_states(conn: AsyncConnection) -> Sequence[Row[*tuple[Any, ...]]]:
    """Every operation's id, kind, state, outcome, next action and amount."""
    rows = await conn.execute(
        select(
            operations.c.operation_id,
            operations.c.kind,
            operations.c.state,
            operations.c.outcome,
            operations.c.next_action,
            operations.c.amount,
        )
    )
    return rows.all()
