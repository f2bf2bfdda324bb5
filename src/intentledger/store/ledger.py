"""The repository: every read and write the engine makes, on one connection.

A `Ledger` wraps the connection of one unit of work (`async with
engine.begin()`); the caller's transaction boundary is the unit of work's.
State changes go through `transition`, which consults the domain's table and
appends the transition row in the same statement batch.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.domain.cards import CARD_KINDS, status_after
from intentledger.domain.evidence import Share, mandate_share, recorded_executions
from intentledger.domain.refunds import refund_mandate_share
from intentledger.domain.states import FINAL, NextAction, Outcome, State, require_transition
from intentledger.domain.watching import is_watched
from intentledger.observability import ledger_events
from intentledger.store import announcements
from intentledger.store.tables import (
    Json,
    Record,
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
    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn
        self._is_postgres = conn.dialect.name == "postgresql"
        # Merchant events this unit of work wrote, by (type, object): a mandate
        # or card changed twice in one transaction is announced once (announcements.py).
        self.announced: dict[tuple[str, str], tuple[str, object]] = {}

    # -- auth ---------------------------------------------------------------

    async def find_api_key(self, token_hash: str) -> Record | None:
        result = await self.conn.execute(
            select(api_keys.c.actor, api_keys.c.is_operator).where(
                api_keys.c.token_hash == token_hash, api_keys.c.revoked_at.is_(None)
            )
        )
        return result.first()

    async def add_api_key(
        self, token_hash: str, actor: str, is_operator: bool, now: datetime
    ) -> int:
        result = await self.conn.execute(
            insert(api_keys).values(
                token_hash=token_hash, actor=actor, is_operator=is_operator, created_at=now
            )
        )
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    async def api_keys(self) -> Sequence[Record]:
        result = await self.conn.execute(select(api_keys).order_by(api_keys.c.id))
        return result.all()

    async def revoke_api_key(self, key_id: int, now: datetime) -> Record | None:
        """Revoke a key (once); the key's row, or None if there is no such key."""
        await self.conn.execute(
            update(api_keys)
            .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
            .values(revoked_at=now)
        )
        found: Record | None = (
            await self.conn.execute(select(api_keys).where(api_keys.c.id == key_id))
        ).first()
        return found

    # -- idempotency records (intake's writes are store/intake.py) ------------

    async def find_idempotency_record(self, actor: str, route: str, key: str) -> Record | None:
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
        return result.first()

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

    async def get_operation(self, operation_id: str, *, for_update: bool = False) -> Record | None:
        query = select(operations).where(operations.c.operation_id == operation_id)
        if for_update:
            query = query.with_for_update()
        return (await self.conn.execute(query)).first()

    async def lock_operation(self, operation_id: str) -> Record | None:
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

    async def transition(
        self,
        operation: Record,
        target: State,
        *,
        now: datetime,
        next_action: NextAction,
        reason: str,
        source: str,
        **fields: Any,
    ) -> None:
        """Move `operation` to `target` if the transition table allows it, and log it."""
        current = State(operation.state)
        require_transition(current, target)
        result = await self.conn.execute(
            update(operations)
            .where(
                operations.c.operation_id == operation.operation_id,
                operations.c.version == operation.version,
            )
            .values(
                state=target,
                next_action=next_action,
                version=operation.version + 1,
                updated_at=now,
                **fields,
            )
        )
        if result.rowcount != 1:
            raise ConcurrentUpdate(operation.operation_id)
        await self.rebook(operation, target, fields, now)
        if operation.kind in CARD_KINDS and target in FINAL:
            await self._settle_card(operation, fields, now)
        await self.conn.execute(
            insert(transitions).values(
                operation_id=operation.operation_id,
                at=now,
                from_state=current,
                to_state=target,
                next_action=next_action,
                reason=reason,
                source=source,
            )
        )
        ledger_events.transition(
            self.conn, operation.operation_id, current, target, next_action, reason
        )
        ledger_events.flags_raised(self.conn, operation, fields)
        after = {**operation._mapping, "state": target, "next_action": next_action, **fields}
        await announcements.operation_changed(self, operation, after, now)

    # -- append-only companions --------------------------------------------

    async def add_observation(self, *, detail: Any = None, **values: Any) -> int:
        """An observation, and its provider answer (`detail`) apart when it has one."""
        observation = insert(observations).values(**values)
        if detail is not None and self.conn.dialect.name == "postgresql":
            # One statement: the answer names the id the server just made (no
            # round trip, and no literal id a recorded statement would repeat).
            made = observation.returning(observations.c.id, observations.c.at).cte("made")
            answer = (
                insert(observation_details)
                .from_select(
                    ["observation_id", "retention_bucket", "detail"],
                    select(made.c.id, made.c.at, bindparam("detail", detail, Json)),
                )
                .returning(observation_details.c.observation_id)
            )
            return int((await self.conn.execute(answer)).scalar_one())
        result = await self.conn.execute(observation)
        observation_id = int(result.inserted_primary_key[0])  # type: ignore[index]
        if detail is not None:
            await self.conn.execute(
                insert(observation_details).values(
                    observation_id=observation_id, retention_bucket=values["at"], detail=detail
                )
            )
        return observation_id

    async def add_decision(self, **values: Any) -> int:
        result = await self.conn.execute(insert(decisions).values(**values))
        ledger_events.decision(self.conn, values)
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    async def add_attempt(self, **values: Any) -> None:
        await self.conn.execute(insert(attempts).values(**values))

    async def last_attempt(self, operation_id: str) -> Record | None:
        result = await self.conn.execute(
            select(attempts)
            .where(attempts.c.operation_id == operation_id)
            .order_by(attempts.c.number.desc())
            .limit(1)
        )
        return result.first()

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

    async def evidence_rows(self, operation_id: str) -> Sequence[Record]:
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
        return result.all()

    async def observations_of_kind(self, operation_id: str, kind: str) -> Sequence[Record]:
        read = observations_with_detail
        result = await self.conn.execute(
            select(read)
            .where(read.c.operation_id == operation_id, read.c.kind == kind)
            .order_by(read.c.id)
        )
        return result.all()

    async def latest_decision(self, operation_id: str) -> Record | None:
        result = await self.conn.execute(
            select(decisions)
            .where(decisions.c.operation_id == operation_id)
            .order_by(decisions.c.id.desc())
            .limit(1)
        )
        latest: Record | None = result.first()
        return latest

    async def refunds_of(self, payment_id: str) -> Sequence[Record]:
        """The payment's refund operations, oldest first."""
        result = await self.conn.execute(
            select(operations)
            .where(operations.c.parent_operation_id == payment_id)
            .order_by(operations.c.created_at, operations.c.operation_id)
        )
        return result.all()

    async def attempts_of(self, operation_id: str) -> Sequence[Record]:
        result = await self.conn.execute(
            select(attempts)
            .where(attempts.c.operation_id == operation_id)
            .order_by(attempts.c.number)
        )
        return result.all()

    async def submit_results_of(self, operation_id: str) -> Sequence[Record]:
        return await self.observations_of_kind(operation_id, "submit_result")

    async def events_of(self, operation_id: str) -> list[tuple[str, Record]]:
        """Transitions, observations and decisions, each tagged with its type."""
        tagged: list[tuple[str, Record]] = []
        for kind, table in (
            ("transition", transitions),
            ("observation", observations_with_detail),
            ("decision", decisions),
        ):
            rows = await self.conn.execute(
                select(table).where(table.c.operation_id == operation_id).order_by(table.c.id)
            )
            tagged.extend((kind, row) for row in rows)
        return tagged

    # -- outbox -------------------------------------------------------------

    async def enqueue(
        self,
        operation_id: str,
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
                kind=kind,
                **new_row_lease(due_at, hold),
                decision_id=decision_id,
                created_at=now,
            )
        )
        return int(result.inserted_primary_key[0])  # type: ignore[index]

    async def get_outbox_row(self, row_id: int) -> Record | None:
        found: Record | None = (
            await self.conn.execute(select(outbox).where(outbox.c.id == row_id))
        ).first()
        return found

    async def claim_outbox_row(self, now: datetime, lease: timedelta, owner: str) -> Record | None:
        """Lease one due row. Its due time moves to the lease's end, so if the
        holder dies the row falls due again by itself (at-least-once delivery)."""
        due = (
            select(outbox.c.id)
            .where(outbox.c.done_at.is_(None), outbox.c.due_at <= now)
            .order_by(outbox.c.due_at)
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
        claimed: Record | None = result.first()
        if claimed is not None:
            ledger_events.claimed(self.conn, [claimed])
        return claimed

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

    async def lookups_of(self, operation_id: str) -> Sequence[Record]:
        return await self.observations_of_kind(operation_id, "lookup_result")

    async def update_operation(self, operation: Record, *, now: datetime, **fields: Any) -> None:
        """Change fields other than the state (those go through `transition`)."""
        assert "state" not in fields, "state changes go through transition()"
        result = await self.conn.execute(
            update(operations)
            .where(
                operations.c.operation_id == operation.operation_id,
                operations.c.version == operation.version,
            )
            .values(version=operation.version + 1, updated_at=now, **fields)
        )
        if result.rowcount != 1:
            raise ConcurrentUpdate(operation.operation_id)
        ledger_events.flags_raised(self.conn, operation, fields)
        await self.rebook(operation, State(operation.state), fields, now)
        if operation.kind == "card_issue" and fields.get("provider_reference"):
            await self._adopt_card_reference(operation, fields["provider_reference"], now)
        await announcements.operation_changed(
            self, operation, {**operation._mapping, **fields}, now
        )

    async def stale_submitting(self, cutoff: datetime, limit: int) -> list[str]:
        result = await self.conn.execute(
            select(operations.c.operation_id)
            .where(operations.c.state == State.SUBMITTING, operations.c.updated_at <= cutoff)
            .limit(limit)
        )
        return [row.operation_id for row in result]

    # -- cards ----------------------------------------------------------------

    async def insert_card(self, **values: Any) -> None:
        await self.conn.execute(insert(cards).values(**values))

    async def get_card(self, card_id: str, *, for_update: bool = False) -> Record | None:
        query = select(cards).where(cards.c.card_id == card_id)
        if for_update:
            query = query.with_for_update()
        found: Record | None = (await self.conn.execute(query)).first()
        return found

    async def update_card(self, card_id: str, now: datetime, **values: Any) -> None:
        await self.conn.execute(
            update(cards)
            .where(cards.c.card_id == card_id)
            .values(version=cards.c.version + 1, updated_at=now, **values)
        )
        await announcements.card_changed(self, card_id, now)

    async def _adopt_card_reference(self, operation: Record, reference: str, now: datetime) -> None:
        """A card settled issued without the provider's card id (a person's word)
        takes the id later evidence names."""
        card = await self.get_card(operation.request_context["card_id"], for_update=True)
        if card is not None and card.provider_card_id is None:
            await self.update_card(card.card_id, now, provider_card_id=reference)

    async def _settle_card(
        self, operation: Record, fields: Mapping[str, Any], now: datetime
    ) -> None:
        """The card's projection leaves `indeterminate` with its operation's outcome."""
        card = await self.get_card(operation.request_context["card_id"], for_update=True)
        if card is None or card.pending_operation_id != operation.operation_id:
            return
        succeeded = fields.get("outcome") == Outcome.SUCCEEDED
        changes: dict[str, Any] = {
            "status": status_after(operation.kind, succeeded, card.status),
            "indeterminate": False,
            "pending_operation_id": None,
        }
        if operation.kind == "card_issue" and succeeded:
            changes["provider_card_id"] = fields.get("provider_reference")
        await self.update_card(card.card_id, now, **changes)

    # -- mandates -------------------------------------------------------------

    async def lock_mandate(self, mandate_id: str) -> Record | None:
        query = select(mandates).where(mandates.c.mandate_id == mandate_id).with_for_update()
        locked: Record | None = (await self.conn.execute(query)).first()
        return locked

    async def get_mandate(self, mandate_id: str) -> Record | None:
        query = select(mandates).where(mandates.c.mandate_id == mandate_id)
        found: Record | None = (await self.conn.execute(query)).first()
        return found

    async def insert_mandate(self, **values: Any) -> None:
        await self.conn.execute(insert(mandates).values(**values))

    async def update_mandate(self, mandate_id: str, now: datetime, **values: Any) -> None:
        await self.conn.execute(
            update(mandates)
            .where(mandates.c.mandate_id == mandate_id)
            .values(version=mandates.c.version + 1, updated_at=now, **values)
        )
        await announcements.mandate_changed(self, mandate_id, now)

    async def rebook(
        self, operation: Record, target: State, fields: Mapping[str, Any], now: datetime
    ) -> None:
        """Bring the mandate's books in line with the operation's change: its share
        (domain.evidence.mandate_share) before the change and after it differ by
        exactly what moves between reserved, spent and free. Evidence counted
        twice changes nothing, because the share is a function of the record."""
        if operation.mandate_id is None:
            return
        before = share_of(operation, State(operation.state))
        after = share_of(operation, target, fields)
        if before == after:
            return
        await self.update_mandate(
            operation.mandate_id,
            now,
            reserved=mandates.c.reserved + (after.reserved - before.reserved),
            spent=mandates.c.spent + (after.spent - before.spent),
        )

    async def accepted_under_mandate(self, mandate_id: str) -> Sequence[Record]:
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
        return result.all()

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


def share_of(operation: Record, state: State, changes: Mapping[str, Any] | None = None) -> Share:
    """The operation's part of its mandate's books, with `changes` applied."""
    changes = changes or {}

    def field(name: str) -> Any:
        return changes.get(name, getattr(operation, name))

    outcome = field("outcome")
    executed = recorded_executions(
        field("executed_references"), outcome, field("provider_reference")
    )
    if operation.kind == "refund":
        return refund_mandate_share(
            operation.amount, state, Outcome(outcome) if outcome else None, executed
        )
    return mandate_share(
        operation.amount,
        state,
        Outcome(outcome) if outcome else None,
        executed,
        keys=field("live_keys"),
        watched=is_watched(field("watch")),
    )
