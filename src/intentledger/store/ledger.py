"""The repository: every read and write the engine makes, on one connection.

A `Ledger` wraps the connection of one unit of work (`async with
engine.begin()`, or on PostgreSQL a worker's batched first attempts' own
connection, store/direct.py); the caller's transaction boundary is the unit
of work's.
It persists and loads; it never decides, renders or counts. A change to an
operation arrives planned (engine/changes.py, the one transition writer) and is
written by `write_operation_change`.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import bindparam, func, insert, select, update

from intentledger.domain.quick_init import quick_init
from intentledger.domain.states import State
from intentledger.store.direct import LedgerConnection
from intentledger.store.records import (
    ApiKeyRecord,
    AttemptRecord,
    CardRecord,
    DecisionRecord,
    IdempotencyRecord,
    MandateRecord,
    ObservationWithDetailRecord,
    OperationRecord,
    OutboxRecord,
    TimelineRecord,
    TransitionRecord,
)
from intentledger.store.tables import (
    Json,
    api_keys,
    attempts,
    cards,
    decisions,
    idempotency_records,
    mandates,
    observation_details,
    observations,
    observations_with_detail,
    operations,
    outbox,
    transitions,
)

# Worker ids of API processes start with this (service.worker_id("api")).
REQUEST_PATH_OWNER = "api"


@dataclass(frozen=True)
class MandateShift:
    """What moves in a mandate's books: added to reserved and to spent (each may
    be negative); the rest of its total limit is free."""

    mandate_id: str
    reserved: int
    spent: int


@quick_init
@dataclass(frozen=True)
class OperationWrite:
    """The rows of one planned change to an operation (engine/changes.py)."""

    operation_id: str
    # The version it was planned from: written only while the row is still at it.
    version: int
    # The columns written, the new version among them.
    values: Mapping[str, Any]
    # The transition row, for a change of state; None for fields only.
    transition: Mapping[str, Any] | None
    shift: MandateShift | None


@dataclass(frozen=True)
class Made:
    """The id the store makes for the `index`-th row of a kind in one `save`:
    a decision may cite this save's observation, an outbox row its decision."""

    kind: str  # "observation" | "decision"
    index: int
    # Which save of its planner it belongs to: an id of an earlier save is
    # never looked up in a later one.
    save: int = 0


@dataclass
class Rows:
    """Everything one unit of work writes, planned before any of it is written
    (engine/changes.Writes plans them; `Ledger.save` writes them in this order)."""

    # Values of `add_observation` (with `detail`, the provider answer, apart).
    observations: list[dict[str, Any]] = field(default_factory=list)
    # Values of `add_decision`; an input may be a `Made` observation id.
    decisions: list[dict[str, Any]] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    changes: list[OperationWrite] = field(default_factory=list)
    # Values of `enqueue`; `decision_id` may be a `Made` decision id.
    outbox: list[dict[str, Any]] = field(default_factory=list)
    finished_outbox_rows: list[int] = field(default_factory=list)
    # The planner's count of saves before this one (`Made.save`).
    save: int = 0

    def __bool__(self) -> bool:
        return any(
            (
                self.observations,
                self.decisions,
                self.attempts,
                self.changes,
                self.outbox,
                self.finished_outbox_rows,
            )
        )


@dataclass(frozen=True)
class Loaded:
    """An operation as a unit of work loads it, locked, with what its rules read."""

    operation: OperationRecord
    # Its attempts, by number.
    attempts: Sequence[AttemptRecord]
    # What the evidence funnel reads of its observations (`evidence_rows`), oldest
    # first; None unless asked for.
    evidence: Sequence[EvidenceRow] | None
    # Whether the delivering outbox row is still leased to its owner (True when
    # no row was named).
    lease_held: bool

    @property
    def last_attempt(self) -> AttemptRecord | None:
        return self.attempts[-1] if self.attempts else None


class KeyHolder(NamedTuple):
    """Who a live API key speaks for."""

    actor: str
    is_operator: bool


class EvidenceRow(NamedTuple):
    """What the evidence funnel reads of an observation."""

    kind: str
    attempt_number: int | None
    verdict: str | None
    provider_reference: str | None


class ConcurrentUpdate(RuntimeError):
    """The operation changed under us: its version is not the one we read."""


def new_operation_id() -> str:
    return "op_" + secrets.token_hex(12)


# What new_operation_id makes: anything else names no operation of ours.
OPERATION_ID = re.compile(r"op_[0-9a-f]{24}")


def new_row_lease(due_at: datetime, hold: tuple[str, timedelta] | None) -> dict[str, Any]:
    """A new outbox row's due time, lease owner and deliveries: due at `due_at`,
    or with `hold=(owner, lease)` already leased to `owner`, which delivers it
    (a synchronous write in the request path); if that process dies, the
    lease runs out and the row falls due like any other."""
    if hold is None:
        return {"due_at": due_at, "lease_owner": None, "deliveries": 0}
    owner, lease = hold
    return {"due_at": due_at + lease, "lease_owner": owner, "deliveries": 1}


class Ledger:
    def __init__(self, conn: LedgerConnection) -> None:
        self.conn = conn
        self._is_postgres = conn.dialect.name == "postgresql"
        # Merchant events this unit of work wrote, by (type, object): a mandate or
        # card changed twice in one transaction is announced once (engine/announcements.py).
        self.announced: dict[tuple[str, str], tuple[str, object]] = {}

    # -- auth ---------------------------------------------------------------

    async def find_api_key(self, token_hash: str) -> KeyHolder | None:
        result = await self.conn.execute(
            select(api_keys.c.actor, api_keys.c.is_operator).where(
                api_keys.c.token_hash == token_hash, api_keys.c.revoked_at.is_(None)
            )
        )
        found = result.first()
        return None if found is None else KeyHolder(*found)

    async def add_api_key(
        self, token_hash: str, actor: str, is_operator: bool, now: datetime
    ) -> int:
        result = await self.conn.execute(
            insert(api_keys).values(
                token_hash=token_hash, actor=actor, is_operator=is_operator, created_at=now
            )
        )
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    async def api_keys(self) -> list[ApiKeyRecord]:
        result = await self.conn.execute(select(api_keys).order_by(api_keys.c.id))
        return [ApiKeyRecord.of(row) for row in result]

    async def revoke_api_key(self, key_id: int, now: datetime) -> ApiKeyRecord | None:
        """Revoke a key (once); the key's row, or None if there is no such key."""
        await self.conn.execute(
            update(api_keys)
            .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
            .values(revoked_at=now)
        )
        found = (await self.conn.execute(select(api_keys).where(api_keys.c.id == key_id))).first()
        return None if found is None else ApiKeyRecord.of(found)

    # -- idempotency records (intake's writes are store/intake.py) ------------

    async def find_idempotency_record(
        self, actor: str, route: str, key: str
    ) -> IdempotencyRecord | None:
        result = await self.conn.execute(
            select(
                idempotency_records.c.request_hash,
                idempotency_records.c.resource_id,
                # The key's first use: the replay window counts from it.
                idempotency_records.c.created_at,
            ).where(
                idempotency_records.c.actor == actor,
                idempotency_records.c.route == route,
                idempotency_records.c.idempotency_key == key,
            )
        )
        found = result.first()
        return None if found is None else IdempotencyRecord(actor, route, key, *found)

    async def add_idempotency_record(
        self, actor: str, route: str, key: str, request_hash: str, resource_id: str, now: datetime
    ) -> None:
        await self.conn.execute(
            insert(idempotency_records).values(
                actor=actor,
                route=route,
                idempotency_key=key,
                request_hash=request_hash,
                resource_id=resource_id,
                created_at=now,
            )
        )

    # -- operations ---------------------------------------------------------

    async def get_operation(
        self, operation_id: str, *, for_update: bool = False
    ) -> OperationRecord | None:
        query = select(operations).where(operations.c.operation_id == operation_id)
        if for_update:
            query = query.with_for_update()
        found = (await self.conn.execute(query)).first()
        return None if found is None else OperationRecord.of(found)

    async def lock_operation(self, operation_id: str) -> OperationRecord | None:
        """Lock an operation for a state change: its mandate first, then the row.

        Every writer takes row locks in one order, mandate -> operation -> outbox
        row (suspension, intake, dispatcher, reconciler, sweeper, operators), so
        they can never deadlock each other. Claiming an outbox row is a
        transaction of its own and holds nothing else.
        """
        mandate_id = (
            await self.conn.execute(
                select(operations.c.mandate_id).where(operations.c.operation_id == operation_id)
            )
        ).scalar_one_or_none()
        if mandate_id is not None:
            await self.lock_mandate(mandate_id)
        return await self.get_operation(operation_id, for_update=True)

    async def load(
        self,
        operation_id: str,
        *,
        delivery: tuple[int, str, datetime] | None = None,
        evidence: bool = False,
    ) -> Loaded | None:
        """Lock the operation (and its mandate first), then the delivering outbox
        row `delivery` = (row id, lease owner, now) if named, and read its
        attempts and, with `evidence`, what the funnel reads: one call for what
        a unit of work decides on. None if there is no such operation."""
        operation = await self.lock_operation(operation_id)
        if operation is None:
            return None
        held = True
        if delivery is not None:
            held = await self.holds_lease(*delivery)
        return Loaded(
            operation,
            await self.attempts_of(operation_id) if held else (),
            await self.evidence_rows(operation_id) if evidence and held else None,
            held,
        )

    async def write_operation_change(self, write: OperationWrite, now: datetime) -> None:
        """One change to an operation as the engine planned it: its new values if
        it is still at the version planned from, what moves in its mandate's
        books, and its transition row."""
        result = await self.conn.execute(
            update(operations)
            .where(
                operations.c.operation_id == write.operation_id,
                operations.c.version == write.version,
            )
            .values(**write.values)
        )
        if result.rowcount != 1:
            raise ConcurrentUpdate(write.operation_id)
        if write.shift is not None:
            await self.shift_mandate(write.shift, now)
        if write.transition is not None:
            await self.conn.execute(insert(transitions).values(**write.transition))

    async def save(self, rows: Rows, now: datetime) -> None:
        """Write a unit of work's planned rows: observations, decisions (citing
        the observations' ids), attempts, the operations' changes, new outbox
        rows (citing the decisions' ids), finished outbox rows."""
        made: dict[Made, int] = {}
        for index, values in enumerate(rows.observations):
            made[Made("observation", index, rows.save)] = await self.add_observation(**values)
        for index, values in enumerate(rows.decisions):
            inputs = values.get("inputs")
            if isinstance(inputs, dict):
                values = {
                    **values,
                    "inputs": {k: made[v] if isinstance(v, Made) else v for k, v in inputs.items()},
                }
            made[Made("decision", index, rows.save)] = await self.add_decision(**values)
        for attempt in rows.attempts:
            await self.add_attempt(**_resolved(attempt, made))
        for write in rows.changes:
            await self.write_operation_change(write, now)
        for values in rows.outbox:
            await self.enqueue(**_resolved(values, made))
        for row_id in rows.finished_outbox_rows:
            await self.finish_outbox_row(row_id, now)

    # -- append-only companions --------------------------------------------

    async def add_observation(self, *, detail: Any = None, **values: Any) -> int:
        """An observation, and its provider answer (`detail`) apart when it has one."""
        observation = insert(observations).values(**values)
        if detail is not None and self.conn.dialect.name == "postgresql":
            # One statement: the answer names the id the server just made (no
            # round trip, and no literal id a recorded statement would repeat).
            made = observation.returning(
                observations.c.id, observations.c.at, observations.c.actor
            ).cte("made")
            answer = (
                insert(observation_details)
                .from_select(
                    ["observation_id", "retention_bucket", "actor", "detail"],
                    select(made.c.id, made.c.at, made.c.actor, bindparam("detail", detail, Json)),
                )
                .returning(observation_details.c.observation_id)
            )
            return int((await self.conn.execute(answer)).scalar_one())
        result = await self.conn.execute(observation)
        observation_id = int(result.inserted_primary_key[0])  # type: ignore[index]
        if detail is not None:
            await self.conn.execute(
                insert(observation_details).values(
                    observation_id=observation_id,
                    retention_bucket=values["at"],
                    actor=values["actor"],
                    detail=detail,
                )
            )
        return observation_id

    async def add_decision(self, **values: Any) -> int:
        result = await self.conn.execute(insert(decisions).values(**values))
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    async def add_attempt(self, **values: Any) -> None:
        await self.conn.execute(insert(attempts).values(**values))

    async def last_attempt(self, operation_id: str) -> AttemptRecord | None:
        result = await self.conn.execute(
            select(attempts)
            .where(attempts.c.operation_id == operation_id)
            .order_by(attempts.c.number.desc())
            .limit(1)
        )
        found = result.first()
        return None if found is None else AttemptRecord.of(found)

    async def first_use_of_key(self, operation_id: str, key: str) -> datetime:
        """When `key` was first sent: a key's age never restarts on a replay."""
        result = await self.conn.execute(
            select(func.min(attempts.c.submitted_at)).where(
                attempts.c.operation_id == operation_id,
                attempts.c.provider_idempotency_key == key,
            )
        )
        first: datetime | None = result.scalar_one()
        if first is None:
            raise LookupError(f"{operation_id} never sent key {key!r}")
        return first if first.tzinfo else first.replace(tzinfo=UTC)

    async def evidence_rows(self, operation_id: str) -> list[EvidenceRow]:
        """What the evidence funnel reads of an operation's observations."""
        result = await self.conn.execute(
            select(
                observations.c.kind,
                observations.c.attempt_number,
                observations.c.verdict,
                observations.c.provider_reference,
            )
            .where(observations.c.operation_id == operation_id)
            .order_by(observations.c.id)
        )
        return [EvidenceRow(*row) for row in result]

    async def observations_of_kind(
        self, operation_id: str, kind: str
    ) -> list[ObservationWithDetailRecord]:
        read = observations_with_detail
        result = await self.conn.execute(
            select(read)
            .where(read.c.operation_id == operation_id, read.c.kind == kind)
            .order_by(read.c.id)
        )
        return [ObservationWithDetailRecord.of(row) for row in result]

    async def latest_decision(self, operation_id: str) -> DecisionRecord | None:
        result = await self.conn.execute(
            select(decisions)
            .where(decisions.c.operation_id == operation_id)
            .order_by(decisions.c.id.desc())
            .limit(1)
        )
        latest = result.first()
        return None if latest is None else DecisionRecord.of(latest)

    async def refunds_of(self, payment_id: str) -> list[OperationRecord]:
        """The payment's refund operations, oldest first."""
        result = await self.conn.execute(
            select(operations)
            .where(operations.c.parent_operation_id == payment_id)
            .order_by(operations.c.created_at, operations.c.operation_id)
        )
        return [OperationRecord.of(row) for row in result]

    async def attempts_of(self, operation_id: str) -> list[AttemptRecord]:
        result = await self.conn.execute(
            select(attempts)
            .where(attempts.c.operation_id == operation_id)
            .order_by(attempts.c.number)
        )
        return [AttemptRecord.of(row) for row in result]

    async def submit_results_of(self, operation_id: str) -> list[ObservationWithDetailRecord]:
        return await self.observations_of_kind(operation_id, "submit_result")

    async def events_of(self, operation_id: str) -> list[tuple[str, TimelineRecord]]:
        """Transitions, observations and decisions, each tagged with its type."""
        tagged: list[tuple[str, TimelineRecord]] = []
        for kind, table, record in (
            ("transition", transitions, TransitionRecord),
            ("observation", observations_with_detail, ObservationWithDetailRecord),
            ("decision", decisions, DecisionRecord),
        ):
            rows = await self.conn.execute(
                select(table).where(table.c.operation_id == operation_id).order_by(table.c.id)
            )
            tagged.extend((kind, record.of(row)) for row in rows)
        return tagged

    # -- outbox -------------------------------------------------------------

    async def enqueue(
        self,
        operation_id: str,
        actor: str,
        kind: str,
        due_at: datetime,
        now: datetime,
        decision_id: int | None = None,
        hold: tuple[str, timedelta] | None = None,
    ) -> int:
        """Add a delivery row; with `hold=(owner, lease)` it starts leased to `owner`."""
        result = await self.conn.execute(
            insert(outbox).values(
                operation_id=operation_id,
                actor=actor,
                kind=kind,
                **new_row_lease(due_at, hold),
                decision_id=decision_id,
                created_at=now,
            )
        )
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    async def get_outbox_row(self, row_id: int) -> OutboxRecord | None:
        found = (await self.conn.execute(select(outbox).where(outbox.c.id == row_id))).first()
        return None if found is None else OutboxRecord.of(found)

    async def claim_outbox_row(
        self, now: datetime, lease: timedelta, owner: str
    ) -> OutboxRecord | None:
        """Lease one due row, the earliest due (of equal due times, the first
        made). Its due time moves to the lease's end, so if the holder dies the
        row falls due again by itself (at-least-once delivery)."""
        due = (
            select(outbox.c.id)
            .where(outbox.c.done_at.is_(None), outbox.c.due_at <= now)
            .order_by(outbox.c.due_at, outbox.c.id)
            .limit(1)
        )
        if self._is_postgres:
            due = due.with_for_update(skip_locked=True)
        result = await self.conn.execute(
            update(outbox)
            .where(outbox.c.id == due.scalar_subquery())
            .values(
                lease_owner=owner,
                due_at=now + lease,
                deliveries=outbox.c.deliveries + 1,
            )
            .returning(outbox)
        )
        claimed = result.first()
        return None if claimed is None else OutboxRecord.of(claimed)

    async def holds_lease(self, row_id: int, owner: str, now: datetime) -> bool:
        """Lock the row and tell whether `owner` still holds an unexpired lease on it."""
        query = select(outbox.c.lease_owner, outbox.c.due_at, outbox.c.done_at).where(
            outbox.c.id == row_id
        )
        row = (await self.conn.execute(query.with_for_update())).first()
        return (
            row is not None
            and row.done_at is None
            and row.lease_owner == owner
            and row.due_at > now
        )

    async def held_by_a_request(self, operation_id: str, now: datetime) -> bool:
        """Is the operation's submit still in the hands of the API request that
        made it (a synchronous write: its row is leased to that process, live)?"""
        query = select(outbox.c.id).where(
            outbox.c.operation_id == operation_id,
            outbox.c.kind == "submit",
            outbox.c.done_at.is_(None),
            outbox.c.lease_owner.like(f"{REQUEST_PATH_OWNER}:%"),
            outbox.c.due_at > now,
        )
        return (await self.conn.execute(query.limit(1))).first() is not None

    async def finish_outbox_row(self, row_id: int, now: datetime) -> None:
        await self.conn.execute(
            update(outbox)
            .where(outbox.c.id == row_id, outbox.c.done_at.is_(None))
            .values(done_at=now)
        )

    async def lookups_of(self, operation_id: str) -> list[ObservationWithDetailRecord]:
        return await self.observations_of_kind(operation_id, "lookup_result")

    async def stale_submitting(self, cutoff: datetime, limit: int) -> list[str]:
        result = await self.conn.execute(
            select(operations.c.operation_id)
            .where(operations.c.state == State.SUBMITTING, operations.c.updated_at <= cutoff)
            # The longest stale first, and always in one order: unordered,
            # PostgreSQL hands rows out as they lie on disk.
            .order_by(operations.c.updated_at, operations.c.operation_id)
            .limit(limit)
        )
        return [row.operation_id for row in result]

    # -- cards ----------------------------------------------------------------

    async def insert_card(self, **values: Any) -> None:
        await self.conn.execute(insert(cards).values(**values))

    async def get_card(self, card_id: str, *, for_update: bool = False) -> CardRecord | None:
        query = select(cards).where(cards.c.card_id == card_id)
        if for_update:
            query = query.with_for_update()
        found = (await self.conn.execute(query)).first()
        return None if found is None else CardRecord.of(found)

    async def update_card(self, card_id: str, now: datetime, **values: Any) -> None:
        await self.conn.execute(
            update(cards)
            .where(cards.c.card_id == card_id)
            .values(version=cards.c.version + 1, updated_at=now, **values)
        )

    # -- mandates -------------------------------------------------------------

    async def lock_mandate(self, mandate_id: str) -> MandateRecord | None:
        query = select(mandates).where(mandates.c.mandate_id == mandate_id).with_for_update()
        locked = (await self.conn.execute(query)).first()
        return None if locked is None else MandateRecord.of(locked)

    async def get_mandate(self, mandate_id: str) -> MandateRecord | None:
        query = select(mandates).where(mandates.c.mandate_id == mandate_id)
        found = (await self.conn.execute(query)).first()
        return None if found is None else MandateRecord.of(found)

    async def insert_mandate(self, **values: Any) -> None:
        await self.conn.execute(insert(mandates).values(**values))

    async def update_mandate(self, mandate_id: str, now: datetime, **values: Any) -> None:
        await self.conn.execute(
            update(mandates)
            .where(mandates.c.mandate_id == mandate_id)
            .values(version=mandates.c.version + 1, updated_at=now, **values)
        )

    async def shift_mandate(self, shift: MandateShift, now: datetime) -> None:
        """Move money between the mandate's reserved, spent and free, relative to
        what the row holds (its lock is held: nothing moves it meanwhile)."""
        await self.update_mandate(
            shift.mandate_id,
            now,
            reserved=mandates.c.reserved + shift.reserved,
            spent=mandates.c.spent + shift.spent,
        )

    async def accepted_under_mandate(self, mandate_id: str) -> list[OperationRecord]:
        """The mandate's payments not yet submitted, locked (after the mandate).
        Refunds of its payments are not among them: a suspension stops charges,
        not money going back."""
        result = await self.conn.execute(
            select(operations)
            .where(
                operations.c.mandate_id == mandate_id,
                operations.c.state == State.ACCEPTED,
                operations.c.kind == "payment",
            )
            .order_by(operations.c.created_at)
            .with_for_update()
        )
        return [OperationRecord.of(row) for row in result]

    async def submit_pending(self, operation_id: str) -> bool:
        """A submit outbox row of the operation not done yet: a call may be in flight."""
        result = await self.conn.execute(
            select(outbox.c.id)
            .where(
                outbox.c.operation_id == operation_id,
                outbox.c.kind == "submit",
                outbox.c.done_at.is_(None),
            )
            .limit(1)
        )
        return result.first() is not None

    async def finish_pending_outbox(self, operation_id: str, now: datetime) -> None:
        await self.conn.execute(
            update(outbox)
            .where(outbox.c.operation_id == operation_id, outbox.c.done_at.is_(None))
            .values(done_at=now)
        )


def _resolved(values: Mapping[str, Any], made: Mapping[Made, int]) -> dict[str, Any]:
    """`values` with a `Made` decision id replaced by the id the store made."""
    decision = values.get("decision_id")
    if isinstance(decision, Made):
        return {**values, "decision_id": made[decision]}
    return dict(values)
