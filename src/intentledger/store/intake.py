"""Intake's writes: the one writer of accepted intents, for a group of any size.

An accepted intent is four rows: its idempotency record (the key's claim),
its ACCEPTED operation, its submit outbox row and its first transition.
`IntakeLedger.accept_group` writes them for every intent whose key it claims;
`IntakeLedger.accept_one` writes the last three for one intent whose key this
transaction claimed first (`claim_keys`), before the checks of its kind
(a mandate's reservation, a card's projection), which a concurrent equal
request must not be judged by.

On PostgreSQL the writer is one statement whatever the group: migration
0019's PL/pgSQL function `intentledger_accept_group`, whose plan the server
keeps per connection even when nothing is prepared (behind a pooler). The
group goes over as one JSON parameter. store/group_statement.py sends the
same call on a psycopg connection of its own: a transport, not a second
writer. On SQLite the writer is the same rule as plain statements
(`_accept_stepwise`), and tests/test_intake_writer.py holds the two to one
model of the rule.

Keys are claimed in key order (the same order in every process, so two
groups cannot deadlock on each other's keys), and of two intents of a group
with one key the earlier claims it. On PostgreSQL an uncommitted
record of a concurrent transaction makes the claim wait for it: if it
commits, nothing is written for that key (the caller reads the record and
answers a replay or a conflict); if it rolls back, ours is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, ClassVar

from sqlalchemy import Insert, bindparam, insert, select, text, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.domain.states import NextAction, State
from intentledger.store.batches import BatchLedger, json_rows, transition_states
from intentledger.store.ledger import new_row_lease
from intentledger.store.records import IdempotencyRecord, OperationRecord
from intentledger.store.tables import (
    UTCDateTime,
    idempotency_records,
    operations,
    outbox,
)

Key = tuple[str, str, str]  # actor, route, Idempotency-Key
# An ACCEPTED operation row and the source of its first transition.
Accepted = tuple[Mapping[str, Any], str]

# The column of the JSON rows that carries each transition's source.
TRANSITION_SOURCE = "transition_source"

# The operation columns `intentledger_accept_group` (migration 0019) reads from
# each row: what `operation_values` writes (engine/intake.py); a test holds
# the two together.
ACCEPT_GROUP_COLUMNS = (
    "operation_id",
    "idempotency_key",
    "state",
    "request_context",
    "next_action",
    "actor",
    "route",
    "kind",
    "request_hash",
    "provider",
    "amount",
    "currency",
    "mandate_id",
    "parent_operation_id",
    "version",
    "duplicate_detected",
    "outcome_contradicted",
    "created_at",
    "updated_at",
)
# The function's call, as SQLAlchemy sends it; store/group_statement.py sends
# the same with libpq's placeholders, its values as text: each argument is
# typed by a cast here or by the function's one signature.
ACCEPT_GROUP_ARGUMENTS = (
    "CAST({rows} AS jsonb), CAST({now} AS timestamptz), {from_state}, {to_state}, "
    "{next_action}, {reason}, CAST({keys_claimed} AS boolean), CAST({due_at} AS timestamptz), "
    "CAST({lease_owner} AS text), CAST({deliveries} AS integer)"
)
ACCEPT_GROUP_PARAMETERS = (
    "rows",
    "now",
    "from_state",
    "to_state",
    "next_action",
    "reason",
    "keys_claimed",
    "due_at",
    "lease_owner",
    "deliveries",
)


def accept_group_call(placeholder: str) -> str:
    """The function's call with each argument written as `placeholder` names
    it: formatted with the parameter's name and its 1-based position in
    `ACCEPT_GROUP_PARAMETERS` (`":{}"`, or `"${1}"` for libpq's own)."""
    arguments = ACCEPT_GROUP_ARGUMENTS.format(
        **{
            name: placeholder.format(name, position)
            for position, name in enumerate(ACCEPT_GROUP_PARAMETERS, 1)
        }
    )
    return f"SELECT new_operation_id, new_outbox_row_id FROM intentledger_accept_group({arguments})"


_ACCEPT_GROUP_CALL = text(accept_group_call(":{}")).bindparams(
    bindparam("now", type_=UTCDateTime()), bindparam("due_at", type_=UTCDateTime())
)


def json_intake_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """Intake's rows as one JSON parameter, by orjson (about a twelfth of the
    CPU of the standard library's `json`).

    Only for these: a validated request's values (integer amounts within 64
    bits, strings, no floats). Elsewhere rows carry provider answers, where
    orjson would refuse an integer beyond 64 bits and write NaN as null.
    Instants are written as every JSON row parameter's are (`json_rows`)."""
    return json_rows(rows)


def accept_group_parameters(
    accepted: Sequence[Accepted],
    reason: str,
    now: datetime,
    *,
    keys_claimed: bool = False,
    hold: tuple[str, timedelta] | None = None,
) -> dict[str, Any]:
    """The writer's parameters, whichever connection sends them (here, or
    store/group_statement.py): the rows with each transition's source as one
    JSON value, the instant, the reason, the transition, and the submit rows'
    start (due now, or leased to `hold`'s owner, as `Ledger.enqueue` starts one)."""
    columns = tuple(accepted[0][0])
    if columns != ACCEPT_GROUP_COLUMNS:
        raise ValueError(f"intake rows of columns {columns} do not fit the writer")
    rows = [{**row, TRANSITION_SOURCE: source} for row, source in accepted]
    return {
        "rows": json_intake_rows(rows),
        "now": now,
        "reason": reason,
        "keys_claimed": keys_claimed,
        **new_row_lease(now, hold),
        **transition_states(None, State.ACCEPTED, NextAction.SUBMIT),
    }


def key_of(row: Mapping[str, Any]) -> Key:
    return (row["actor"], row["route"], row["idempotency_key"])


class IntakeLedger:
    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    # Claim a key unless its record exists, on either database; RETURNING names
    # the record only when this statement inserted it.
    _claim_key_statements: ClassVar[Mapping[str, Insert]] = {
        "postgresql": postgresql.insert(idempotency_records)
        .on_conflict_do_nothing(index_elements=list(idempotency_records.primary_key))
        .returning(idempotency_records.c.resource_id),
        "sqlite": sqlite.insert(idempotency_records)
        .on_conflict_do_nothing(index_elements=list(idempotency_records.primary_key))
        .returning(idempotency_records.c.resource_id),
    }

    async def claim_keys(self, records: Sequence[Mapping[str, Any]]) -> set[str]:
        """Write each idempotency record unless its key already has one; the
        resource ids of the records written. On PostgreSQL an uncommitted record
        of a concurrent transaction makes this wait for it: if it commits,
        nothing is written (and a SELECT after this one sees that record); if it
        rolls back, ours is. Give the records in key order (see the module)."""
        statement = self._claim_key_statements[self.conn.dialect.name]
        result = await self.conn.execute(statement, list(records))
        return {row.resource_id for row in result}

    async def accept_group(
        self, accepted: Sequence[Accepted], reason: str, now: datetime
    ) -> set[str]:
        """For each (ACCEPTED operation row, source of its first transition):
        claim its key, and for the keys claimed write the operation, its due
        submit row and its first transition. The operation ids whose keys were
        claimed; the others' keys had a record (a replay or a conflict)."""
        if not accepted:
            return set()
        written = await self._accept(accepted, reason, now, keys_claimed=False, hold=None)
        return set(written)

    async def accept_one(
        self,
        operation: Mapping[str, Any],
        source: str,
        reason: str,
        now: datetime,
        hold: tuple[str, timedelta] | None = None,
    ) -> int:
        """`accept_group` for one intent whose key this transaction has claimed
        (or an operator's remedy, made under the operator's own key): the
        operation, its submit row (with `hold=(owner, lease)` leased to `owner`
        from the start) and its first transition. The submit row's id."""
        written = await self._accept(
            [(operation, source)], reason, now, keys_claimed=True, hold=hold
        )
        return written[operation["operation_id"]]

    async def _accept(
        self,
        accepted: Sequence[Accepted],
        reason: str,
        now: datetime,
        *,
        keys_claimed: bool,
        hold: tuple[str, timedelta] | None,
    ) -> dict[str, int]:
        """The writer: each new operation's id and its submit row's id."""
        parameters = accept_group_parameters(
            accepted, reason, now, keys_claimed=keys_claimed, hold=hold
        )
        if self.conn.dialect.name == "postgresql":
            result = await self.conn.execute(_ACCEPT_GROUP_CALL, parameters)
            return {row.new_operation_id: row.new_outbox_row_id for row in result}
        return await self._accept_stepwise(accepted, parameters)

    async def _accept_stepwise(
        self, accepted: Sequence[Accepted], parameters: Mapping[str, Any]
    ) -> dict[str, int]:
        """The function of migration 0019 as plain statements, for SQLite."""
        now = parameters["now"]
        if parameters["keys_claimed"]:
            new = list(accepted)
        else:
            claimed = await self.claim_keys(
                [
                    {
                        "actor": row["actor"],
                        "route": row["route"],
                        "idempotency_key": row["idempotency_key"],
                        "request_hash": row["request_hash"],
                        "resource_id": row["operation_id"],
                        "created_at": now,
                    }
                    for row, _ in sorted(accepted, key=lambda pair: key_of(pair[0]))
                ]
            )
            new = [(row, source) for row, source in accepted if row["operation_id"] in claimed]
        if not new:
            return {}
        await self.conn.execute(insert(operations), [dict(row) for row, _ in new])
        rows = await self.conn.execute(
            insert(outbox).returning(
                outbox.c.operation_id, outbox.c.id, sort_by_parameter_order=True
            ),
            [
                {
                    "operation_id": row["operation_id"],
                    "actor": row["actor"],
                    "kind": "submit",
                    "due_at": parameters["due_at"],
                    "lease_owner": parameters["lease_owner"],
                    "deliveries": parameters["deliveries"],
                    "decision_id": None,
                    "created_at": now,
                }
                for row, _ in new
            ],
        )
        written = {row.operation_id: row.id for row in rows}
        await BatchLedger(self.conn).log_transitions(
            [
                (row["operation_id"], row["actor"], parameters["reason"], source)
                for row, source in new
            ],
            None,
            State.ACCEPTED,
            NextAction.SUBMIT,
            now,
        )
        return written

    # -- a group's retries ------------------------------------------------------

    async def idempotency_records(self, keys: Sequence[Key]) -> dict[Key, IdempotencyRecord]:
        """The records of (actor, route, idempotency key) triples that have one."""
        wanted = sorted(set(keys))
        rows = await self.conn.execute(
            select(idempotency_records).where(
                tuple_(
                    idempotency_records.c.actor,
                    idempotency_records.c.route,
                    idempotency_records.c.idempotency_key,
                ).in_(wanted)
            )
        )
        return {
            (row.actor, row.route, row.idempotency_key): IdempotencyRecord.of(row) for row in rows
        }

    async def operations(self, operation_ids: Sequence[str]) -> dict[str, OperationRecord]:
        rows = await self.conn.execute(
            select(operations).where(operations.c.operation_id.in_(sorted(set(operation_ids))))
        )
        return {row.operation_id: OperationRecord.of(row) for row in rows}
