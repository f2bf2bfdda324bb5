"""The one transition writer: how any change to an operation reaches the ledger.

A caller (the dispatcher, single or batched, the funnel's carrying out, the
reconciler, the sweeper, mandates, refunds, operators) holds the operation's
lock and asks for a state or its fields to change. `plan` asks the domain and
returns the rows that change is — the record's new values (checked against
the version read), the transition row, what moves in its mandate's books —
and `write` hands them to one store function, then carries the change into
what it touches: the card's projection, the merchant's news, and the metrics
counted when the transaction commits. The batch plans each change the same
way, persists them set-at-a-time, and follows them with the same `follow`.

The store persists and loads; it never decides, renders or counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from intentledger.domain.cards import CARD_KINDS, adopted_card_id, settled_projection
from intentledger.domain.evidence import Share, mandate_share, recorded_executions
from intentledger.domain.quick_init import quick_init
from intentledger.domain.refunds import refund_mandate_share
from intentledger.domain.states import (
    FINAL,
    NextAction,
    Outcome,
    State,
    require_transition,
    state_of,
)
from intentledger.domain.watching import is_watched
from intentledger.engine import announcements
from intentledger.observability import ledger_events
from intentledger.store.ledger import Ledger, Made, MandateShift, OperationWrite, Rows
from intentledger.store.records import OperationRecord


@quick_init
@dataclass(frozen=True)
class OperationChange:
    """One change to one operation, decided before any of it is written."""

    before: OperationRecord
    target: State
    rows: OperationWrite
    now: datetime

    @property
    def operation_id(self) -> str:
        return self.rows.operation_id

    @property
    def values(self) -> Mapping[str, Any]:
        return self.rows.values

    @property
    def fields(self) -> dict[str, Any]:
        """What changes besides the state, the version and the time."""
        return {
            k: v
            for k, v in self.values.items()
            if k not in ("state", "next_action", "version", "updated_at")
        }


def plan(
    operation: OperationRecord,
    target: State | None,
    *,
    now: datetime,
    next_action: NextAction | None = None,
    reason: str | None = None,
    source: str | None = None,
    **fields: Any,
) -> OperationChange:
    """The rows of moving `operation` to `target` (None: its fields only), if
    the transition table allows it. Pure: reads nothing, writes nothing."""
    current = state_of(operation.state)
    values: dict[str, Any] = {"version": operation.version + 1, "updated_at": now}
    transition = None
    if target is None:
        assert "state" not in fields, "a state changes with a transition"
        target = current
        if next_action is not None:
            values["next_action"] = next_action
    else:
        assert next_action is not None and reason is not None and source is not None
        require_transition(current, target)
        values["state"] = target
        values["next_action"] = next_action
        transition = {
            "operation_id": operation.operation_id,
            "actor": operation.actor,
            "at": now,
            "from_state": current,
            "to_state": target,
            "next_action": next_action,
            "reason": reason,
            "source": source,
        }
    values.update(fields)
    rows = OperationWrite(
        operation.operation_id,
        operation.version,
        values,
        transition,
        _mandate_shift(operation, target, fields),
    )
    return OperationChange(operation, target, rows, now)


def _mandate_shift(
    operation: OperationRecord, target: State, fields: Mapping[str, Any]
) -> MandateShift | None:
    """The mandate's books follow the operation: its share (domain.evidence.
    mandate_share) before the change and after it differ by exactly what moves
    between reserved, spent and free. Evidence counted twice changes nothing,
    because the share is a function of the record."""
    if operation.mandate_id is None:
        return None
    before = share_of(operation, State(operation.state))
    after = share_of(operation, target, fields)
    if before == after:
        return None
    return MandateShift(
        operation.mandate_id, after.reserved - before.reserved, after.spent - before.spent
    )


def share_of(
    operation: OperationRecord, state: State, changes: Mapping[str, Any] | None = None
) -> Share:
    """The operation's part of its mandate's books, with `changes` applied."""
    changes = changes or {}

    def field(name: str) -> Any:
        return changes.get(name, getattr(operation, name))

    outcome = field("outcome")
    executed = recorded_executions(
        field("executed_references"), outcome, field("provider_reference")
    )
    assert operation.amount is not None, "an operation under a mandate moves an amount"
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


def alike(changes: Sequence[OperationChange]) -> list[OperationWrite]:
    """The changes' rows with one set of columns, in one order, so a batch
    writes them in one statement: a column one change sets and another does
    not (a decline adopts no reference) is written by the other with the value
    its record holds, unchanged under the lock it was planned with."""
    columns = list(dict.fromkeys(itertools.chain.from_iterable(c.values for c in changes)))
    order = tuple(columns)
    rows = []
    for change in changes:
        values = change.values
        if tuple(values) == order:
            # Already these columns in this order (a group of successes): as is.
            rows.append(change.rows)
            continue
        current = None if len(values) == len(columns) else change.before.as_dict()
        rows.append(
            replace(
                change.rows,
                values={
                    name: values[name] if current is None or name in values else current[name]
                    for name in columns
                },
            )
        )
    return rows


async def write(ledger: Ledger, change: OperationChange) -> None:
    """Persist one change (one store call), then what it touches."""
    await ledger.write_operation_change(change.rows, change.now)
    await follow(ledger, [change])


async def follow(
    ledger: Ledger, changes: Sequence[OperationChange], *, stage: str | None = None
) -> None:
    """What persisted changes touch besides their own rows: the mandate's and
    the card's news and projection, the metrics at commit, the operations' news
    (merchant events read the record as the transaction leaves it). `stage`:
    the changes are one batch's, all the same transition, counted as a group."""
    if not changes:
        return
    # The mandates' news first, as one change at a time wrote it, each at the
    # instant of the changes that shifted it (a group's changes share one).
    shifted = [change for change in changes if change.rows.shift is not None]
    for now, at_now in itertools.groupby(shifted, key=lambda change: change.now):
        await announcements.mandates_changed(
            ledger, [change.rows.shift.mandate_id for change in at_now if change.rows.shift], now
        )
    for change in changes:
        await _project_card(ledger, change)
        if change.rows.transition is not None and stage is None:
            ledger_events.transition(
                ledger.conn,
                change.operation_id,
                State(change.before.state),
                change.target,
                change.values["next_action"],
                change.rows.transition["reason"],
            )
        ledger_events.flags_raised(ledger.conn, change.before, change.values)
    if stage is not None:
        first = changes[0]
        assert all(
            c.rows.transition is not None
            and c.before.state == first.before.state
            and c.target is first.target
            for c in changes
        ), "a batch's changes are one transition"
        ledger_events.transitions(
            ledger.conn, State(first.before.state), first.target, len(changes), stage
        )
    await announcements.operations_changed(
        ledger, [(change.before, change.values) for change in changes], changes[0].now
    )


async def transition(
    ledger: Ledger,
    operation: OperationRecord,
    target: State,
    *,
    now: datetime,
    next_action: NextAction,
    reason: str,
    source: str,
    **fields: Any,
) -> None:
    """Move `operation` (locked) to `target` if the transition table allows it, and log it."""
    await write(
        ledger,
        plan(
            operation,
            target,
            now=now,
            next_action=next_action,
            reason=reason,
            source=source,
            **fields,
        ),
    )


async def update(
    ledger: Ledger, operation: OperationRecord, *, now: datetime, **fields: Any
) -> None:
    """Change fields other than the state (those change with `transition`)."""
    next_action = fields.pop("next_action", None)
    await write(ledger, plan(operation, None, now=now, next_action=next_action, **fields))


async def _project_card(ledger: Ledger, change: OperationChange) -> None:
    """A card's projection follows its operation: it leaves `indeterminate` with
    the operation's outcome, and a card settled issued without the provider's
    card id (a person's word) takes the id later evidence names."""
    operation = change.before
    if operation.kind not in CARD_KINDS:
        return
    fields = change.fields
    if change.rows.transition is not None and change.target in FINAL:
        card = await ledger.get_card(operation.request_context["card_id"], for_update=True)
        if card is None or card.pending_operation_id != operation.operation_id:
            return
        succeeded = fields.get("outcome") == Outcome.SUCCEEDED
        projection = settled_projection(
            operation.kind, succeeded, card.status, fields.get("provider_reference")
        )
        await change_card(ledger, card.card_id, change.now, **projection)
    elif (
        change.rows.transition is None
        and operation.kind == "card_issue"
        and fields.get("provider_reference")
    ):
        card = await ledger.get_card(operation.request_context["card_id"], for_update=True)
        adopted = (
            adopted_card_id(operation.kind, card.provider_card_id, fields["provider_reference"])
            if card is not None
            else None
        )
        if card is not None and adopted is not None:
            await change_card(ledger, card.card_id, change.now, provider_card_id=adopted)


async def change_card(ledger: Ledger, card_id: str, now: datetime, **values: Any) -> None:
    """A card's projection changes, and the merchant hears of it."""
    await ledger.update_card(card_id, now, **values)
    await announcements.card_changed(ledger, card_id, now)


async def change_mandate(ledger: Ledger, mandate_id: str, now: datetime, **values: Any) -> None:
    """A mandate's status or books change, and the merchant hears of it."""
    await ledger.update_mandate(mandate_id, now, **values)
    await announcements.mandate_changed(ledger, mandate_id, now)


async def decide(ledger: Ledger, **values: Any) -> int:
    """A decision row, counted (and logged) when the transaction commits."""
    decision_id = await ledger.add_decision(**values)
    ledger_events.decision(ledger.conn, values)
    return decision_id


class Writes:
    """One unit of work's rows, planned while it decides and saved at its end
    in one store call (`save`): a decision cites the observation planned
    beside it, an outbox row its decision, by the `Made` id the store fills in."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.rows = Rows()
        self.changes: list[OperationChange] = []

    def observe(self, **values: Any) -> Made:
        self.rows.observations.append(values)
        return Made("observation", len(self.rows.observations) - 1, self.rows.save)

    def decide(self, **values: Any) -> Made:
        for cited in values.get("inputs", {}).values():
            self._unsaved(cited)
        self.rows.decisions.append(values)
        return Made("decision", len(self.rows.decisions) - 1, self.rows.save)

    def _unsaved(self, cited: object) -> None:
        """A `Made` id cited is one this save will make (an earlier save's
        rows are written: cite the id that save made, not its placeholder)."""
        assert not isinstance(cited, Made) or cited.save == self.rows.save, cited

    def attempt(self, **values: Any) -> None:
        self.rows.attempts.append(values)

    def change(self, change: OperationChange) -> None:
        self.changes.append(change)
        self.rows.changes.append(change.rows)

    def enqueue(
        self,
        operation: OperationRecord,
        kind: str,
        due_at: datetime,
        decision: Made | int | None = None,
    ) -> None:
        self.rows.outbox.append(
            {
                "operation_id": operation.operation_id,
                "actor": operation.actor,
                "kind": kind,
                "due_at": due_at,
                "now": self.now,
                "decision_id": decision,
            }
        )
        self._unsaved(decision)

    def finish(self, outbox_row_id: int) -> None:
        self.rows.finished_outbox_rows.append(outbox_row_id)

    async def save(self, ledger: Ledger) -> None:
        """Write what is planned (one store call), then what it touches; the
        planner starts empty again, for what a caller plans after."""
        rows, planned = self.rows, self.changes
        self.rows, self.changes = Rows(save=rows.save + 1), []
        if not rows:
            return
        await ledger.save(rows, self.now)
        for values in rows.decisions:
            ledger_events.decision(ledger.conn, values)
        await follow(ledger, planned)
