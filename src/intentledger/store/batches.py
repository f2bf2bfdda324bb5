"""Set-at-a-time reads and writes for batched first attempts.

The same rows `Ledger` writes one operation at a time, written for many
operations in a few statements: one claim, one lock per table, one multi-row
insert per append-only table, one update per kind of change. Locks are taken
in the one order every writer uses (mandates, then operations, then outbox
rows), each set sorted by key so two batches can never deadlock each other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

import orjson
from sqlalchemy import (
    Integer,
    Select,
    Table,
    TextClause,
    Update,
    bindparam,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect

from intentledger.domain.states import NextAction, State
from intentledger.domain.transport import Transport, Verdict
from intentledger.store.direct import LedgerConnection
from intentledger.store.ids import IDS, among_ids, id_reads
from intentledger.store.ledger import ConcurrentUpdate, Ledger, OperationWrite
from intentledger.store.records import (
    AttemptRecord,
    MandateRecord,
    ObservationWithDetailRecord,
    OperationRecord,
    OutboxRecord,
)
from intentledger.store.tables import (
    UTCDateTime,
    attempts,
    mandates,
    observation_details,
    observations,
    observations_with_detail,
    operations,
    outbox,
    transitions,
)

# The batch's reads and locks are built once: building a statement and its
# cache key on every call was most of SQLAlchemy's share of a worker's CPU.
# Their ids are one parameter (`among_ids`), whatever their number.


@cache
def _claim_statement(is_postgres: bool) -> Update:
    """Lease the due rows: the claim Ledger.claim_outbox_row makes, for many
    (SKIP LOCKED on PostgreSQL; SQLite has one writer)."""
    due = (
        select(outbox.c.id)
        .where(outbox.c.done_at.is_(None), outbox.c.due_at <= bindparam("now"))
        .order_by(outbox.c.due_at, outbox.c.id)
        .limit(bindparam("claim_limit", type_=Integer()))
    )
    if is_postgres:
        due = due.with_for_update(skip_locked=True)
    return (
        update(outbox)
        .where(outbox.c.id.in_(due.scalar_subquery()))
        .values(
            lease_owner=bindparam("owner"),
            due_at=bindparam("lease_until"),
            deliveries=outbox.c.deliveries + 1,
        )
        .returning(outbox)
    )


_under_mandate = operations.alias("under_mandate")


@dataclass(frozen=True)
class _LockStatements:
    # Locks the operations in one statement if none of them has a mandate (an
    # operation's mandate is set at intake and never changes, so what it reads
    # stays true under the locks); it returns no row when one has, and `lock`
    # then takes the mandates first.
    without_mandates: Select[Any]
    mandates_of: Select[Any]
    mandates: Select[Any]
    operations: Select[Any]
    outbox_rows: Select[Any]


@cache
def _lock_statements(is_postgres: bool) -> _LockStatements:
    """The batch's reads and locks for the dialect, built once."""
    return _LockStatements(
        without_mandates=select(operations)
        .where(
            among_ids(operations.c.operation_id, is_postgres),
            ~select(_under_mandate.c.operation_id)
            .where(
                among_ids(_under_mandate.c.operation_id, is_postgres),
                _under_mandate.c.mandate_id.is_not(None),
            )
            .exists(),
        )
        .order_by(operations.c.operation_id)
        .with_for_update(of=operations),
        mandates_of=select(operations.c.mandate_id)
        .where(
            among_ids(operations.c.operation_id, is_postgres),
            operations.c.mandate_id.is_not(None),
        )
        .distinct(),
        mandates=select(mandates)
        .where(among_ids(mandates.c.mandate_id, is_postgres))
        .order_by(mandates.c.mandate_id)
        .with_for_update(),
        operations=select(operations)
        .where(among_ids(operations.c.operation_id, is_postgres))
        .order_by(operations.c.operation_id)
        .with_for_update(),
        outbox_rows=select(outbox.c.id, outbox.c.lease_owner, outbox.c.due_at, outbox.c.done_at)
        .where(among_ids(outbox.c.id, is_postgres))
        .order_by(outbox.c.id)
        .with_for_update(),
    )


@dataclass(frozen=True)
class _PartsStatements:
    operations: Select[Any]
    attempts: Select[Any]
    submit_results: Select[Any]
    refunds: Select[Any]


@cache
def _parts_statements(is_postgres: bool) -> _PartsStatements:
    """The reads of `BatchLedger.parts_of`, built once: Ledger's reads of one
    operation's parts, for many."""
    read = observations_with_detail
    return _PartsStatements(
        operations=select(operations).where(among_ids(operations.c.operation_id, is_postgres)),
        attempts=select(attempts)
        .where(among_ids(attempts.c.operation_id, is_postgres))
        .order_by(attempts.c.operation_id, attempts.c.number),
        submit_results=select(read)
        .where(among_ids(read.c.operation_id, is_postgres), read.c.kind == "submit_result")
        .order_by(read.c.id),
        refunds=select(operations)
        .where(among_ids(operations.c.parent_operation_id, is_postgres))
        .order_by(operations.c.created_at, operations.c.operation_id),
    )


@dataclass(frozen=True)
class OperationParts:
    """An operation as GET shows it: the record, its attempts (by number), their
    submit results (oldest first) and, for a payment, its refunds (oldest first)."""

    operation: OperationRecord
    attempts: list[AttemptRecord]
    submit_results: list[ObservationWithDetailRecord]
    refunds: list[OperationRecord]


@dataclass(frozen=True)
class Locked:
    """Operations locked for a state change, and the mandates locked before them."""

    operations: dict[str, OperationRecord]
    mandates: dict[str, MandateRecord]


class BatchLedger:
    def __init__(self, conn: LedgerConnection) -> None:
        self.conn = conn
        self._is_postgres = conn.dialect.name == "postgresql"

    async def claim_outbox_rows(
        self, now: datetime, lease: timedelta, owner: str, limit: int
    ) -> list[OutboxRecord]:
        """Lease up to `limit` due rows, earliest due first (see Ledger.claim_outbox_row)."""
        result = await self.conn.execute(
            _claim_statement(self._is_postgres),
            {"now": now, "lease_until": now + lease, "owner": owner, "claim_limit": limit},
        )
        # `.all()` here and below: the rows are in memory already, and iterating
        # a result fetches them a row (three Python calls) at a time.
        claimed = [OutboxRecord.of(row) for row in result.all()]
        return sorted(claimed, key=lambda row: (row.created_at, row.id))

    async def lock(self, operation_ids: Iterable[str]) -> Locked:
        """Lock the operations' mandates, then the operations (Ledger.lock_operation's order)."""
        ids = sorted(set(operation_ids))
        statements = _lock_statements(self._is_postgres)
        alone = await self.conn.execute(statements.without_mandates, {"ids": ids})
        locked = {row.operation_id: OperationRecord.of(row) for row in alone.all()}
        if locked:
            return Locked(locked, {})
        mandate_ids = (await self.conn.execute(statements.mandates_of, {"ids": ids})).scalars()
        locked_mandates: dict[str, MandateRecord] = {}
        wanted = sorted(mandate_ids)
        if wanted:
            rows = await self.conn.execute(statements.mandates, {"ids": wanted})
            locked_mandates = {row.mandate_id: MandateRecord.of(row) for row in rows.all()}
        rows = await self.conn.execute(statements.operations, {"ids": ids})
        return Locked(
            {row.operation_id: OperationRecord.of(row) for row in rows.all()}, locked_mandates
        )

    async def parts_of(self, operation_ids: Iterable[str]) -> dict[str, OperationParts]:
        """Each existing operation of `operation_ids` with its parts, in four reads
        however many there are, up to `IDS_PER_READ` (Ledger's `get_operation`,
        `attempts_of`, `submit_results_of` and `refunds_of` are four per operation)."""
        statements = _parts_statements(self._is_postgres)
        parts: dict[str, OperationParts] = {}
        for read in id_reads(operation_ids):
            for row in (await self.conn.execute(statements.operations, read)).all():
                parts[row.operation_id] = OperationParts(OperationRecord.of(row), [], [], [])
            for row in (await self.conn.execute(statements.attempts, read)).all():
                parts[row.operation_id].attempts.append(AttemptRecord.of(row))
            for row in (await self.conn.execute(statements.submit_results, read)).all():
                parts[row.operation_id].submit_results.append(ObservationWithDetailRecord.of(row))
            payments = [i for i in read[IDS] if i in parts and parts[i].operation.kind == "payment"]
            if payments:
                for row in (await self.conn.execute(statements.refunds, {IDS: payments})).all():
                    parts[row.parent_operation_id].refunds.append(OperationRecord.of(row))
        return parts

    async def leases_held(self, row_ids: Iterable[int], owner: str, now: datetime) -> set[int]:
        """Lock the outbox rows; the ones `owner` still holds an unexpired lease on."""
        rows = await self.conn.execute(
            _lock_statements(self._is_postgres).outbox_rows, {"ids": sorted(set(row_ids))}
        )
        return {
            row.id
            for row in rows.all()
            if row.done_at is None and row.lease_owner == owner and row.due_at > now
        }

    async def begin_attempts(
        self,
        attempt_rows: Sequence[Mapping[str, Any]],
        writes: Sequence[OperationWrite],
        now: datetime,
    ) -> None:
        """Write each attempt and its operation's planned change (ACCEPTED ->
        SUBMITTING, engine/dispatcher.begin_attempt), for operations this
        transaction has locked; on PostgreSQL in one statement."""
        assert sorted(w.operation_id for w in writes) == sorted(
            row["operation_id"] for row in attempt_rows
        )
        await self._write_changes(writes, now, attempt_rows=attempt_rows)

    async def settle(
        self,
        observation_rows: Sequence[Mapping[str, Any]],
        writes: Sequence[OperationWrite],
        outbox_row_ids: Sequence[int],
        now: datetime,
        *,
        unlocked: bool = False,
    ) -> None:
        """Write each answer's observation and its operation's planned change (an
        outcome, engine/evidence.settlement), and mark the rows that delivered
        them done; on PostgreSQL in one statement. `unlocked`: the changes
        were planned without reading their operations under this
        transaction's locks, so the write takes the locks first, in key
        order, as every writer of many operations does."""
        await self._write_changes(
            writes,
            now,
            observation_rows=observation_rows,
            done_outbox_rows=outbox_row_ids,
            unlocked=unlocked,
        )

    async def _write_changes(
        self,
        writes: Sequence[OperationWrite],
        now: datetime,
        *,
        attempt_rows: Sequence[Mapping[str, Any]] = (),
        observation_rows: Sequence[Mapping[str, Any]] = (),
        done_outbox_rows: Sequence[int] = (),
        unlocked: bool = False,
    ) -> None:
        """Planned changes set-at-a-time, beside the rows they come with. Every
        change is written only while its operation is at the version it was
        planned from (the locks make that so; the count proves it)."""
        if not writes:
            return
        by_columns: dict[tuple[str, ...], list[OperationWrite]] = {}
        for write in writes:
            by_columns.setdefault(tuple(write.values), []).append(write)
        written: int | None
        if self._is_postgres and len(by_columns) == 1:
            written = await self._write_in_one_statement(
                writes, now, attempt_rows, observation_rows, done_outbox_rows, unlocked
            )
        else:
            # Only the one statement locks what it was not given locked (a
            # group record plans without a read on PostgreSQL alone, its
            # changes `alike`).
            assert not unlocked, "changes planned without their locks take the one statement"
            written = await self._write_stepwise(
                by_columns, now, attempt_rows, observation_rows, done_outbox_rows
            )
        if written is not None and written != len(writes):
            raise ConcurrentUpdate(", ".join(w.operation_id for w in writes))
        ledger = Ledger(self.conn)
        for write in writes:
            if write.shift is not None:
                await ledger.shift_mandate(write.shift, now)

    async def _write_in_one_statement(
        self,
        writes: Sequence[OperationWrite],
        now: datetime,
        attempt_rows: Sequence[Mapping[str, Any]],
        observation_rows: Sequence[Mapping[str, Any]],
        done_outbox_rows: Sequence[int],
        unlocked: bool,
    ) -> int:
        columns = tuple(writes[0].values)
        statement = _changes_sql(
            self.conn.dialect,
            columns,
            tuple(attempt_rows[0]) if attempt_rows else (),
            tuple(observation_rows[0]) if observation_rows else (),
            bool(done_outbox_rows),
            unlocked,
        )
        parameters: dict[str, Any] = {
            "writes": json_rows(
                [
                    {**w.values, _PLANNED_FROM: w.version, "operation_id": w.operation_id}
                    for w in writes
                ]
            ),
            "transitions": json_rows([w.transition for w in writes if w.transition is not None]),
        }
        if unlocked:
            parameters[_LOCKED_IDS] = sorted(w.operation_id for w in writes)
        if attempt_rows:
            parameters["attempts"] = json_rows(attempt_rows)
        if observation_rows:
            parameters["observations"] = _json_answer_rows(observation_rows)
        if done_outbox_rows:
            # Rows, like every JSON parameter here (the bench's recorder reads them so).
            parameters["outbox_rows"] = json_rows(
                [{"id": i} for i in sorted(set(done_outbox_rows))]
            )
            parameters["now"] = now
        result = await self.conn.execute(statement, parameters)
        return int(result.scalar_one())

    async def _write_stepwise(
        self,
        by_columns: Mapping[tuple[str, ...], Sequence[OperationWrite]],
        now: datetime,
        attempt_rows: Sequence[Mapping[str, Any]],
        observation_rows: Sequence[Mapping[str, Any]],
        done_outbox_rows: Sequence[int],
    ) -> int | None:
        """`_write_changes` statement by statement; the count of changes written,
        where the driver can report it for an executemany."""
        if attempt_rows:
            await self.conn.execute(insert(attempts), list(attempt_rows))
        if observation_rows:
            await self._add_observations(observation_rows)
        written: int | None = 0
        for columns, group in by_columns.items():
            stmt = (
                update(operations)
                .where(
                    operations.c.operation_id == bindparam("w_operation_id"),
                    operations.c.version == bindparam("w_planned_from"),
                )
                .values({name: bindparam(f"w_{name}") for name in columns})
            )
            params = [
                {
                    "w_operation_id": w.operation_id,
                    "w_planned_from": w.version,
                    **{f"w_{name}": value for name, value in w.values.items()},
                }
                for w in group
            ]
            result = await self.conn.execute(stmt, params)
            if written is not None and self.conn.dialect.supports_sane_multi_rowcount:
                written += result.rowcount
            else:
                written = None
        transition_rows = [w.transition for sub in by_columns.values() for w in sub if w.transition]
        if transition_rows:
            await self.conn.execute(insert(transitions), transition_rows)
        if done_outbox_rows:
            await self.finish_outbox_rows(done_outbox_rows, now)
        return written

    async def _add_observations(self, rows: Sequence[Mapping[str, Any]]) -> None:
        observed = [dict(row) for row in rows]
        answers = [row.pop("detail", None) for row in observed]
        ids = (
            await self.conn.execute(
                insert(observations).returning(observations.c.id, sort_by_parameter_order=True),
                observed,
            )
        ).scalars()
        details = [
            {
                "observation_id": observation_id,
                "retention_bucket": row["at"],
                "actor": row["actor"],
                "detail": detail,
            }
            for observation_id, row, detail in zip(ids, observed, answers, strict=True)
            if detail is not None
        ]
        if details:
            await self.conn.execute(insert(observation_details), details)

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
        entries: Sequence[tuple[str, str, str, str]],
        from_state: State | None,
        to_state: State,
        next_action: NextAction,
        now: datetime,
    ) -> None:
        """One transition row per (operation id, actor, reason, source)."""
        await self.conn.execute(
            insert(transitions),
            [
                {
                    "operation_id": operation_id,
                    "actor": actor,
                    "at": now,
                    "from_state": from_state,
                    "to_state": to_state,
                    "next_action": next_action,
                    "reason": reason,
                    "source": source,
                }
                for operation_id, actor, reason, source in entries
            ],
        )


def json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as one JSON parameter, for `jsonb_to_recordset` to read back.

    Only for rows our code makes (attempts, operations' values, transitions,
    outbox ids, and intake's validated requests: strings, integers within 64
    bits, instants, states, lists of references), written by orjson: the
    standard library's encoder was 12 % of a worker's CPU. Rows carrying
    provider answers go through `_json_answer_rows`.

    A group's rows share their instants (the transaction's `now`, mostly):
    each distinct instant in UTC is written once per call. orjson's call
    back into Python for every instant cost about 6 µs (docs/benchmarks.md,
    step 53). Only instants in UTC itself are kept: Python calls two
    instants equal when their wall-clock readings match in the same zone,
    even an hour apart across a change of clocks (`fold`), and those must
    not share a text; our clock and our columns give UTC."""
    instant = _instants_written_once()
    return orjson.dumps(rows, default=instant, option=orjson.OPT_PASSTHROUGH_DATETIME).decode()


def _json_answer_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """Observation rows, whose `detail` is a provider's answer as parsed,
    written as the standard library writes them (`_stdlib_answer_rows`),
    by orjson wherever that writes the same JSON: about three fifths of the
    standard library's CPU, the walk below included (docs/benchmarks.md,
    "Answers written by orjson").

    orjson differs from the standard library in two ways that matter here.
    It refuses an integer beyond 64 bits, a lone surrogate, a name that is
    not text, a body nested past its depth and any type it does not know:
    those rows are written by the standard library instead. And it writes
    NaN and the infinities as null, silently: rows holding one are written
    by the standard library too, which writes NaN as NaN (the database
    refuses it, the group fails and each answer takes the reference path,
    as before). An answer `providers.http.answer_of` read holds none of
    these; only a plug-in's own answer can. Each distinct instant is written
    once, as in `json_rows`."""
    if _written_alike_by_orjson(rows):
        try:
            return orjson.dumps(
                rows, default=_instants_written_once(), option=orjson.OPT_PASSTHROUGH_DATETIME
            ).decode()
        except orjson.JSONEncodeError:
            pass
    return _stdlib_answer_rows(rows)


def _stdlib_answer_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as the standard library writes them: an integer beyond 64
    bits as it came, NaN as NaN."""
    return json.dumps(rows, default=_instants_written_once(), ensure_ascii=False)


# The types both encoders write as themselves (an enum of text as its
# value), or hand to `default` (an instant): the plain ones and the rows' own
# columns, told apart by `type()` at the cost of a set lookup.
_WRITTEN_AS_THEMSELVES = frozenset(
    {str, int, bool, type(None), datetime, State, NextAction, Transport, Verdict}
)
# The most dicts, lists and tuples one call walks before it leaves the rows
# to the standard library: a cycle (a plug-in's answer that holds itself)
# would keep the walk going for ever, where the standard library raises.
_CONTAINERS_WALKED_AT_MOST = 10_000


def _written_alike_by_orjson(value: Any) -> bool:
    """Whether orjson, if it writes `value` at all, writes the JSON the
    standard library writes: its dicts, lists and tuples hold only text,
    integers (an enum of either kind too), booleans, null, finite floats
    and instants (both hand those to `default`). Anything else (NaN or an
    infinity, a subclass of a float, dict or list, an enum of other values,
    a type only orjson knows, more containers than a cycle-free answer
    holds) is the standard library's to write or refuse. Without
    recursion: a plug-in's answer may nest deeper than the stack goes.
    Types are told by `type()`, which an object cannot fake as it can its
    `__class__`."""
    pending = [value]
    containers = _CONTAINERS_WALKED_AT_MOST
    while pending:
        item = pending.pop()
        kind = type(item)
        if kind in _WRITTEN_AS_THEMSELVES:
            continue
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is dict or kind is list or kind is tuple:
            containers -= 1
            if containers < 0:
                return False
            pending.extend(item.values() if kind is dict else item)
        elif not issubclass(kind, str | int | datetime):
            return False
    return True


def _instants_written_once() -> Callable[[object], str]:
    """`json_instant` for one call's rows, each instant in UTC written once
    (`json_rows` says why only those)."""
    written: dict[datetime, str] = {}

    def instant(value: object) -> str:
        if type(value) is not datetime or value.tzinfo is not UTC:
            return json_instant(value)
        text = written.get(value)
        if text is None:
            text = written[value] = json_instant(value)
        return text

    return instant


def json_instant(value: object) -> str:
    if isinstance(value, datetime):
        # Aware and with microseconds, so PostgreSQL reads back the same instant.
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def transition_states(
    from_state: State | None, to_state: State, next_action: NextAction
) -> dict[str, str | None]:
    """A transition's states, as the parameters of the statements below."""
    return {
        "from_state": from_state.value if from_state else None,
        "to_state": to_state.value,
        "next_action": next_action.value,
    }


def recordset_columns(dialect: Dialect, table: Table, columns: Iterable[str]) -> str:
    """A `jsonb_to_recordset` column list typed from `table`'s definition, so
    the rows are typed exactly as an INSERT of the same values would type them."""
    return ", ".join(f"{name} {table.c[name].type.compile(dialect=dialect)}" for name in columns)


# The parameter of `_changes_sql` naming the operations it locks first.
_LOCKED_IDS = "locked_ids"
# The column of the JSON rows of `_changes_sql` naming the version a change was planned from.
_PLANNED_FROM = "planned_from_version"


@cache
def _changes_sql(
    dialect: Dialect,
    value_columns: tuple[str, ...],
    attempt_columns: tuple[str, ...],
    observation_columns: tuple[str, ...],
    finish_outbox_rows: bool,
    lock_first: bool,
) -> TextClause:
    """`_write_changes` on PostgreSQL as one statement: the operations locked in
    key order if the changes were planned without their locks, the attempts and the
    observations that come with the changes (each observation's id drawn first,
    so that its provider answer, `detail`, can name it; a JSON null is SQL NULL
    and writes no answer, as the stepwise path writes none for a None), the
    operations' new values where each is still at the version it was planned
    from, the transition rows, the delivering outbox rows done (by key alone: a
    `done_at IS NULL` predicate could walk the pending-rows index). The number
    of operations changed."""
    steps: list[str] = []
    if attempt_columns:
        names = ", ".join(attempt_columns)
        steps.append(
            f"""new_attempts AS (
            INSERT INTO attempts ({names})
            SELECT {names} FROM jsonb_to_recordset(CAST(:attempts AS jsonb))
                AS r({recordset_columns(dialect, attempts, attempt_columns)})
        )"""
        )
    if observation_columns:
        fields = [name for name in observation_columns if name != "detail"]
        names = ", ".join(fields)
        record = recordset_columns(dialect, observations, fields)
        if "detail" in observation_columns:
            record += f", {recordset_columns(dialect, observation_details, ['detail'])}"
        steps.append(
            f"""answers AS MATERIALIZED (
            SELECT nextval((SELECT pg_get_serial_sequence('observations', 'id')::regclass))
                AS id, r.*
            FROM jsonb_to_recordset(CAST(:observations AS jsonb)) AS r({record})
        ), new_observations AS (
            INSERT INTO observations (id, {names}) SELECT id, {names} FROM answers
        )"""
        )
        if "detail" in observation_columns:
            steps.append(
                """new_details AS (
            INSERT INTO observation_details (observation_id, retention_bucket, actor, detail)
            SELECT id, at, actor, detail FROM answers WHERE detail IS NOT NULL
        )"""
            )
    assignments = ", ".join(f"{name} = w.{name}" for name in value_columns)
    written = recordset_columns(dialect, operations, ("operation_id", *value_columns))
    transition_columns = tuple(c.name for c in transitions.c if c.name != "id")
    transition_names = ", ".join(transition_columns)
    locked_join = ""
    if lock_first:
        # The operations' locks are taken in key order, as every writer of
        # many operations takes them: the update changes only rows `locked`
        # has produced, and it produces (and locks) them one after another by
        # key, whatever plan the update takes. It runs as far as the update
        # reads it: a row it never reaches is one whose version moved on, and
        # the count then sends the group back to be planned under locks.
        steps.insert(
            0,
            f"""locked AS MATERIALIZED (
            SELECT o.operation_id FROM operations AS o
            WHERE o.operation_id = ANY(:{_LOCKED_IDS})
            ORDER BY o.operation_id
            FOR UPDATE
        )""",
        )
        locked_join = "JOIN locked ON locked.operation_id = w.operation_id"
    steps.append(
        f"""changed AS (
            UPDATE operations AS o SET {assignments}
            FROM jsonb_to_recordset(CAST(:writes AS jsonb))
                AS w({written}, {_PLANNED_FROM} integer)
                {locked_join}
            WHERE o.operation_id = w.operation_id AND o.version = w.{_PLANNED_FROM}
            RETURNING o.operation_id
        ), new_transitions AS (
            INSERT INTO transitions ({transition_names})
            SELECT {transition_names} FROM jsonb_to_recordset(CAST(:transitions AS jsonb))
                AS t({recordset_columns(dialect, transitions, transition_columns)})
        )"""
    )
    if finish_outbox_rows:
        steps.append(
            """done AS (
            UPDATE outbox SET done_at = :now
            WHERE id IN (
                SELECT d.id FROM jsonb_to_recordset(CAST(:outbox_rows AS jsonb)) AS d(id bigint)
            )
        )"""
        )
    statement = text("WITH " + ", ".join(steps) + " SELECT count(*) FROM changed")
    if finish_outbox_rows:
        statement = statement.bindparams(bindparam("now", type_=UTCDateTime()))
    if lock_first:
        statement = statement.bindparams(
            bindparam(_LOCKED_IDS, type_=ARRAY(operations.c.operation_id.type))
        )
    return statement
