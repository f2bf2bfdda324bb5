"""Set-at-a-time reads and writes for batched first attempts.

The same rows `Ledger` writes one operation at a time, written for many
operations in a few statements: one claim, one lock per table, one multi-row
insert per append-only table, one update per kind of change. Locks are taken
in the one order every writer uses (mandates, then operations, then outbox
rows), each set sorted by key so two batches can never deadlock each other.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import Table, TextClause, bindparam, func, insert, select, text, update
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.domain.states import NextAction, State, require_transition
from intentledger.observability import ledger_events
from intentledger.store import announcements
from intentledger.store.ledger import ConcurrentUpdate, Ledger
from intentledger.store.tables import (
    Record,
    UTCDateTime,
    attempts,
    mandates,
    observation_details,
    observations,
    operations,
    outbox,
    transitions,
)


@dataclass(frozen=True)
class Locked:
    """Operations locked for a state change, and the mandates locked before them."""

    operations: dict[str, Record]
    mandates: dict[str, Record]


@dataclass(frozen=True)
class Settlement:
    """One operation's final outcome, from an answer to its attempt: the
    observation of that answer, and the outbox row that delivered it."""

    operation: Record
    outcome: str
    provider_reference: str | None
    reason: str
    observation: Mapping[str, Any]
    outbox_row_id: int


class BatchLedger:
    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn
        self._is_postgres = conn.dialect.name == "postgresql"

    async def claim_outbox_rows(
        self, now: datetime, lease: timedelta, owner: str, limit: int
    ) -> list[Record]:
        """Lease up to `limit` due rows, earliest due first (see Ledger.claim_outbox_row)."""
        due = (
            select(outbox.c.id)
            .where(outbox.c.done_at.is_(None), outbox.c.due_at <= now)
            .order_by(outbox.c.due_at)
            .limit(limit)
        )
        if self._is_postgres:
            due = due.with_for_update(skip_locked=True)
        result = await self.conn.execute(
            update(outbox)
            .where(outbox.c.id.in_(due.scalar_subquery()))
            .values(lease_owner=owner, due_at=now + lease, deliveries=outbox.c.deliveries + 1)
            .returning(outbox)
        )
        rows = sorted(result.all(), key=lambda row: (row.created_at, row.id))
        ledger_events.claimed(self.conn, rows)
        return rows

    async def lock(self, operation_ids: Iterable[str]) -> Locked:
        """Lock the operations' mandates, then the operations (Ledger.lock_operation's order)."""
        ids = sorted(set(operation_ids))
        mandate_ids = (
            await self.conn.execute(
                select(operations.c.mandate_id)
                .where(operations.c.operation_id.in_(ids), operations.c.mandate_id.is_not(None))
                .distinct()
            )
        ).scalars()
        locked_mandates: dict[str, Record] = {}
        wanted = sorted(mandate_ids)
        if wanted:
            rows = await self.conn.execute(
                select(mandates)
                .where(mandates.c.mandate_id.in_(wanted))
                .order_by(mandates.c.mandate_id)
                .with_for_update()
            )
            locked_mandates = {row.mandate_id: row for row in rows}
        rows = await self.conn.execute(
            select(operations)
            .where(operations.c.operation_id.in_(ids))
            .order_by(operations.c.operation_id)
            .with_for_update()
        )
        return Locked({row.operation_id: row for row in rows}, locked_mandates)

    async def leases_held(self, row_ids: Iterable[int], owner: str, now: datetime) -> set[int]:
        """Lock the outbox rows; the ones `owner` still holds an unexpired lease on."""
        rows = await self.conn.execute(
            select(outbox.c.id, outbox.c.lease_owner, outbox.c.due_at, outbox.c.done_at)
            .where(outbox.c.id.in_(sorted(set(row_ids))))
            .order_by(outbox.c.id)
            .with_for_update()
        )
        return {
            row.id
            for row in rows
            if row.done_at is None and row.lease_owner == owner and row.due_at > now
        }

    async def begin_attempts(
        self,
        attempt_rows: Sequence[Mapping[str, Any]],
        locked: Sequence[Record],
        *,
        now: datetime,
        reasons: Mapping[str, str],
        source: str,
    ) -> None:
        """Write each attempt and move its operation ACCEPTED -> SUBMITTING, for
        operations this transaction has locked (one attempt row per operation).

        One update for all of them: the row locks make the versions we read the
        current ones, so the version check of `Ledger.transition` holds by
        construction; the row count still proves it. On PostgreSQL the attempts,
        the update and the transitions are one statement (`_begin_attempts_sql`).
        """
        require_transition(State.ACCEPTED, State.SUBMITTING)
        assert all(State(op.state) is State.ACCEPTED for op in locked)
        ids = [op.operation_id for op in locked]
        assert sorted(ids) == sorted(row["operation_id"] for row in attempt_rows)
        begin = self._begin_in_one_statement if self._is_postgres else self._begin_stepwise
        if await begin(attempt_rows, now, reasons, source) != len(ids):
            raise ConcurrentUpdate(", ".join(ids))
        ledger_events.transitions(
            self.conn, State.ACCEPTED, State.SUBMITTING, len(ids), "pre_submit"
        )

    async def _begin_in_one_statement(
        self,
        attempt_rows: Sequence[Mapping[str, Any]],
        now: datetime,
        reasons: Mapping[str, str],
        source: str,
    ) -> int:
        rows = [{**row, _REASON: reasons[row["operation_id"]]} for row in attempt_rows]
        result = await self.conn.execute(
            _begin_attempts_sql(self.conn.dialect, tuple(attempt_rows[0])),
            {
                "rows": _json_rows(rows),
                "now": now,
                "source": source,
                **_states(State.ACCEPTED, State.SUBMITTING, NextAction.WAIT),
            },
        )
        return int(result.scalar_one())

    async def _begin_stepwise(
        self,
        attempt_rows: Sequence[Mapping[str, Any]],
        now: datetime,
        reasons: Mapping[str, str],
        source: str,
    ) -> int:
        """`begin_attempts` as three statements; the number of operations updated."""
        ids = [row["operation_id"] for row in attempt_rows]
        await self.conn.execute(insert(attempts), list(attempt_rows))
        # By key alone: a predicate on `state` could lead the planner to the
        # state index and through every ACCEPTED operation.
        result = await self.conn.execute(
            update(operations)
            .where(operations.c.operation_id.in_(ids))
            .values(
                state=State.SUBMITTING,
                next_action=NextAction.WAIT,
                version=operations.c.version + 1,
                updated_at=now,
                first_attempt_at=func.coalesce(operations.c.first_attempt_at, now),
            )
        )
        await self.log_transitions(
            [(operation_id, reasons[operation_id], source) for operation_id in ids],
            State.ACCEPTED,
            State.SUBMITTING,
            NextAction.WAIT,
            now,
        )
        return result.rowcount

    async def settle(
        self, settlements: Sequence[Settlement], *, now: datetime, source: str
    ) -> None:
        """SUBMITTING -> OUTCOME_KNOWN, as `engine.audit.settle` does one at a time,
        for operations that never used a second provider key (so no duplicate
        audit is due): the answer's observation, the outcome (if the operation's
        version is still the one settled from), the transition and the outbox row
        done. Mandate reservations follow the outcome. On PostgreSQL all but the
        reservations are one statement (`_settle_sql`).
        """
        require_transition(State.SUBMITTING, State.OUTCOME_KNOWN)
        write = self._settle_in_one_statement if self._is_postgres else self._settle_stepwise
        settled = await write(settlements, now, source)
        if settled is not None and settled != len(settlements):
            raise ConcurrentUpdate(", ".join(s.operation.operation_id for s in settlements))
        ledger_events.transitions(
            self.conn, State.SUBMITTING, State.OUTCOME_KNOWN, len(settlements), "settle"
        )
        ledger = Ledger(self.conn)
        for s in settlements:
            await ledger.rebook(
                s.operation,
                State.OUTCOME_KNOWN,
                {"outcome": s.outcome, "provider_reference": s.provider_reference},
                now,
            )
        # The merchant's news, in this transaction too (store/announcements.py).
        actors = {s.operation.actor for s in settlements}
        listening = await announcements.listening_endpoints(ledger, actors)
        for s in settlements:
            endpoints = listening.get(s.operation.actor)
            if endpoints:
                after = {**s.operation._mapping, "state": State.OUTCOME_KNOWN}
                await announcements.operation_changed(ledger, s.operation, after, now, endpoints)

    async def _settle_in_one_statement(
        self, settlements: Sequence[Settlement], now: datetime, source: str
    ) -> int:
        observed = [dict(s.observation) for s in settlements]
        outcomes = [
            {
                "operation_id": s.operation.operation_id,
                "version": s.operation.version,
                "outcome": s.outcome,
                "provider_reference": s.provider_reference,
                _REASON: s.reason,
                "outbox_row_id": s.outbox_row_id,
            }
            for s in settlements
        ]
        result = await self.conn.execute(
            _settle_sql(self.conn.dialect, tuple(observed[0])),
            {
                "observations": _json_rows(observed),
                "outcomes": _json_rows(outcomes),
                "now": now,
                "source": source,
                **_states(State.SUBMITTING, State.OUTCOME_KNOWN, NextAction.NONE),
            },
        )
        return int(result.scalar_one())

    async def _settle_stepwise(
        self, settlements: Sequence[Settlement], now: datetime, source: str
    ) -> int | None:
        """`settle` as four statements; the count of outcomes written, where the
        driver can report it for an executemany."""
        observed = [dict(s.observation) for s in settlements]
        answers = [row.pop("detail", None) for row in observed]
        ids = (
            await self.conn.execute(
                insert(observations).returning(observations.c.id, sort_by_parameter_order=True),
                observed,
            )
        ).scalars()
        details = [
            {"observation_id": observation_id, "retention_bucket": row["at"], "detail": detail}
            for observation_id, row, detail in zip(ids, observed, answers, strict=True)
            if detail is not None
        ]
        if details:
            await self.conn.execute(insert(observation_details), details)
        stmt = (
            update(operations)
            .where(
                operations.c.operation_id == bindparam("b_operation_id"),
                operations.c.version == bindparam("b_version"),
                operations.c.state == State.SUBMITTING,
            )
            .values(
                state=State.OUTCOME_KNOWN,
                next_action=NextAction.NONE,
                version=bindparam("b_new_version"),
                updated_at=now,
                outcome=bindparam("b_outcome"),
                provider_reference=bindparam("b_provider_reference"),
                last_observed_at=now,
                retry_after_at=None,
            )
        )
        params = [
            {
                "b_operation_id": s.operation.operation_id,
                "b_version": s.operation.version,
                "b_new_version": s.operation.version + 1,
                "b_outcome": s.outcome,
                "b_provider_reference": s.provider_reference,
            }
            for s in settlements
        ]
        result = await self.conn.execute(stmt, params)
        await self.log_transitions(
            [(s.operation.operation_id, s.reason, source) for s in settlements],
            State.SUBMITTING,
            State.OUTCOME_KNOWN,
            NextAction.NONE,
            now,
        )
        await self.finish_outbox_rows((s.outbox_row_id for s in settlements), now)
        return result.rowcount if self.conn.dialect.supports_sane_multi_rowcount else None

    async def finish_outbox_rows(self, row_ids: Iterable[int], now: datetime) -> None:
        """Mark delivered rows done. Only for rows whose operation this transaction
        holds unchanged since their pre-submit: nobody else can have finished them.
        (By key alone: `done_at IS NULL` would match the pending-rows index, and
        the planner could walk every pending row.)"""
        await self.conn.execute(
            update(outbox).where(outbox.c.id.in_(sorted(set(row_ids)))).values(done_at=now)
        )

    async def log_transitions(
        self,
        entries: Sequence[tuple[str, str, str]],
        from_state: State | None,
        to_state: State,
        next_action: NextAction,
        now: datetime,
    ) -> None:
        """One transition row per (operation id, reason, source)."""
        await self.conn.execute(
            insert(transitions),
            [
                {
                    "operation_id": operation_id,
                    "at": now,
                    "from_state": from_state,
                    "to_state": to_state,
                    "next_action": next_action,
                    "reason": reason,
                    "source": source,
                }
                for operation_id, reason, source in entries
            ],
        )


# The column of the JSON rows below that carries each transition's reason.
_REASON = "transition_reason"


def _json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as one JSON parameter, for `jsonb_to_recordset` to read back."""
    return json.dumps(rows, default=_json_instant, ensure_ascii=False)


def _json_instant(value: object) -> str:
    if isinstance(value, datetime):
        # Aware and with microseconds, so PostgreSQL reads back the same instant.
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _states(
    from_state: State | None, to_state: State, next_action: NextAction
) -> dict[str, str | None]:
    """A transition's states, as the parameters of the statements below."""
    return {
        "from_state": from_state.value if from_state else None,
        "to_state": to_state.value,
        "next_action": next_action.value,
    }


def _record(dialect: Dialect, table: Table, columns: Iterable[str]) -> str:
    """A `jsonb_to_recordset` column list typed from `table`'s definition, so
    the rows are typed exactly as an INSERT of the same values would type them."""
    return ", ".join(f"{name} {table.c[name].type.compile(dialect=dialect)}" for name in columns)


@cache
def _begin_attempts_sql(dialect: Dialect, columns: tuple[str, ...]) -> TextClause:
    """`begin_attempts` on PostgreSQL as one statement, for attempt rows with
    these columns: the attempts, ACCEPTED -> SUBMITTING by key alone (see the
    stepwise update), a transition each; the number of operations updated."""
    names = ", ".join(columns)
    sql = f"""
        WITH batch AS (
            SELECT * FROM jsonb_to_recordset(CAST(:rows AS jsonb))
                AS r({_record(dialect, attempts, columns)}, {_REASON} text)
        ), new_attempts AS (
            INSERT INTO attempts ({names}) SELECT {names} FROM batch
        ), submitting AS (
            UPDATE operations
            SET state = :to_state, next_action = :next_action, version = version + 1,
                updated_at = :now, first_attempt_at = COALESCE(first_attempt_at, :now)
            WHERE operation_id IN (SELECT operation_id FROM batch)
            RETURNING operation_id
        ), new_transitions AS (
            INSERT INTO transitions
                (operation_id, at, from_state, to_state, next_action, reason, source)
            SELECT operation_id, :now, :from_state, :to_state, :next_action, {_REASON}, :source
            FROM batch
        )
        SELECT count(*) FROM submitting
    """
    return text(sql).bindparams(bindparam("now", type_=UTCDateTime()))


@cache
def _settle_sql(dialect: Dialect, columns: tuple[str, ...]) -> TextClause:
    """`settle` on PostgreSQL, but for mandate reservations, as one statement, for
    observation rows with these columns; the number of outcomes written.

    An outcome is written only while the operation is SUBMITTING at the version
    settled from, as the stepwise update checks; the outbox rows are marked done
    by key alone, as in `finish_outbox_rows`. Each observation's id is drawn
    first, so that its provider answer (`detail`, when there is one: the
    stepwise path writes none for a Python None, and `jsonb_to_recordset`
    reads a JSON null as SQL NULL) can name it.
    """
    fields = [name for name in columns if name != "detail"]
    names = ", ".join(fields)
    record = _record(dialect, observations, fields)
    if "detail" in columns:
        record += f", {_record(dialect, observation_details, ['detail'])}"
    details = (
        """, new_details AS (
            INSERT INTO observation_details (observation_id, retention_bucket, detail)
            SELECT id, at, detail FROM answers WHERE detail IS NOT NULL
        )"""
        if "detail" in columns
        else ""
    )
    sql = f"""
        WITH answers AS MATERIALIZED (
            SELECT nextval((SELECT pg_get_serial_sequence('observations', 'id')::regclass))
                AS id, r.*
            FROM jsonb_to_recordset(CAST(:observations AS jsonb)) AS r({record})
        ), settled AS (
            SELECT * FROM jsonb_to_recordset(CAST(:outcomes AS jsonb)) AS r(
                {
        _record(dialect, operations, ("operation_id", "version", "outcome", "provider_reference"))
    },
                {_REASON} text, outbox_row_id bigint)
        ), new_observations AS (
            INSERT INTO observations (id, {names}) SELECT id, {names} FROM answers
        ){details}, outcomes AS (
            UPDATE operations AS o
            SET state = :to_state, next_action = :next_action, version = s.version + 1,
                updated_at = :now, outcome = s.outcome,
                provider_reference = s.provider_reference, last_observed_at = :now,
                retry_after_at = NULL
            FROM settled AS s
            WHERE o.operation_id = s.operation_id AND o.version = s.version
              AND o.state = :from_state
            RETURNING o.operation_id
        ), new_transitions AS (
            INSERT INTO transitions
                (operation_id, at, from_state, to_state, next_action, reason, source)
            SELECT operation_id, :now, :from_state, :to_state, :next_action, {_REASON}, :source
            FROM settled
        ), done AS (
            UPDATE outbox SET done_at = :now
            WHERE id IN (SELECT outbox_row_id FROM settled)
        )
        SELECT count(*) FROM outcomes
    """
    return text(sql).bindparams(bindparam("now", type_=UTCDateTime()))
