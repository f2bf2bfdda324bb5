"""Intake's one writer (store/intake.py) against a plain model of the rule.

On PostgreSQL the writer is migration 0019's PL/pgSQL function, on SQLite
its plain-statement twin. Each runs here against the same model, so the two
are proven equal to each other through it (and each can be checked alone,
when only one database is at hand). The model: the first intent of a group
with a key that has no record claims it, and gets its record, its ACCEPTED
operation, its submit row (due now, or leased to the request that holds it)
and its first transition; every other intent writes nothing, and is a replay
of the record's operation when its request equals the recorded one, else a
conflict.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.replay_window import DEFAULT_REPLAY_WINDOW
from intentledger.engine.clock import system_clock
from intentledger.engine.intake import ACCEPTED_REASON, Intent, operation_values
from intentledger.engine.refusal import IdempotencyKeyReused, replay_of
from intentledger.store.intake import IntakeLedger
from intentledger.store.tables import idempotency_records, operations, outbox, transitions

ROUTES = ("POST /v1/payments", "POST /v1/refunds")
KINDS = ("payment", "beneficiary", "card_issue", "refund")
HOLD = ("api:test-writer", timedelta(seconds=30))


@dataclass(frozen=True)
class Planned:
    actor: str
    route: str
    key: str
    request: str  # which of two requests: equal requests have equal hashes
    kind: str
    amount: int


planned = st.builds(
    Planned,
    actor=st.sampled_from(["ana", "ben"]),
    route=st.sampled_from(ROUTES),
    key=st.sampled_from(["k1", "k2", "k3"]),
    request=st.sampled_from(["first", "second"]),
    kind=st.sampled_from(KINDS),
    amount=st.integers(min_value=1, max_value=10**12),
)


def values_of(plan: Planned, tag: str, now: Any) -> dict[str, Any]:
    """The operation row `accept()` would write for this intent (a refund names its payment)."""
    body = {"amount": plan.amount, "currency": "EUR", "note": plan.request}
    intent = Intent(
        actor=f"{tag}-{plan.actor}",
        route=plan.route,
        idempotency_key=plan.key,
        request_hash=f"{plan.request}:{plan.actor}:{plan.key}".ljust(64, "h"),
        body=body,
        provider="sandbox",
        kind=plan.kind,
    )
    values = operation_values(intent, now)
    if plan.kind == "refund":
        values["parent_operation_id"] = "op_" + "0" * 24
    return values


def key_of(values: dict[str, Any]) -> tuple[str, str, str]:
    return (values["actor"], values["route"], values["idempotency_key"])


def source_of(values: dict[str, Any]) -> str:
    return f"api:{values['actor']}"


async def written(engine: AsyncEngine, tag: str) -> dict[str, set[tuple[Any, ...]]]:
    """The records, submit rows and transitions the writer made for this
    example's actors, without generated ids."""
    mine = f"{tag}-%"
    async with engine.connect() as conn:
        records = await conn.execute(
            select(idempotency_records).where(idempotency_records.c.actor.like(mine))
        )
        ids = list(
            (
                await conn.execute(
                    select(operations.c.operation_id).where(operations.c.actor.like(mine))
                )
            ).scalars()
        )
        boxes = await conn.execute(select(outbox).where(outbox.c.operation_id.in_(ids)))
        moves = await conn.execute(select(transitions).where(transitions.c.operation_id.in_(ids)))
        return {
            "records": {
                (r.actor, r.route, r.idempotency_key, r.request_hash, r.resource_id, r.created_at)
                for r in records
            },
            "outbox": {
                (
                    b.operation_id,
                    b.kind,
                    b.due_at,
                    b.lease_owner,
                    b.deliveries,
                    b.decision_id,
                    b.done_at,
                    b.created_at,
                )
                for b in boxes
            },
            "transitions": {
                (t.operation_id, t.at, t.from_state, t.to_state, t.next_action, t.reason, t.source)
                for t in moves
            },
        }


def expected_rows(
    accepted: list[tuple[dict[str, Any], Any, tuple[str, timedelta] | None]],
) -> dict[str, set[tuple[Any, ...]]]:
    """The model's rows for the intents it accepted: (values, instant, hold)."""
    rows: dict[str, set[tuple[Any, ...]]] = {
        "records": set(),
        "outbox": set(),
        "transitions": set(),
    }
    for values, now, hold in accepted:
        op_id = values["operation_id"]
        owner, lease = hold if hold else (None, timedelta(0))
        rows["records"].add((*key_of(values), values["request_hash"], op_id, now))
        rows["outbox"].add((op_id, "submit", now + lease, owner, 1 if hold else 0, None, None, now))
        rows["transitions"].add(
            (op_id, now, None, "ACCEPTED", "submit", ACCEPTED_REASON, source_of(values))
        )
    return rows


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    recorded=st.lists(planned, max_size=4),
    group=st.lists(planned, min_size=1, max_size=8),
    one_by_one=st.booleans(),
    held=st.booleans(),
)
async def test_the_writer_does_what_the_model_of_the_rule_says(
    engine: AsyncEngine,
    recorded: list[Planned],
    group: list[Planned],
    one_by_one: bool,
    held: bool,
) -> None:
    tag = uuid.uuid4().hex[:12]
    earlier, now = system_clock() - timedelta(seconds=5), system_clock()

    # Keys recorded before: through the writer, as an earlier group.
    before = [values_of(plan, tag, earlier) for plan in recorded]
    async with engine.begin() as conn:
        await IntakeLedger(conn).accept_group(
            [(v, source_of(v)) for v in before], ACCEPTED_REASON, earlier
        )

    # The model.
    records: dict[tuple[str, str, str], dict[str, Any]] = {}
    accepted: list[tuple[dict[str, Any], Any, tuple[str, timedelta] | None]] = []
    for values in before:
        if key_of(values) not in records:
            records[key_of(values)] = values
            accepted.append((values, earlier, None))
    already = dict(records)
    intents = [values_of(plan, tag, now) for plan in group]
    hold = HOLD if one_by_one and held else None
    claimed_by_model: set[str] = set()
    for values in intents:
        if key_of(values) not in records:
            records[key_of(values)] = values
            accepted.append((values, now, hold))
            claimed_by_model.add(values["operation_id"])

    # The writer: a group, or each intent on its own as `accept()` takes it
    # (its key claimed first, then its rows, its submit row held when asked).
    claimed: set[str] = set()
    if one_by_one:
        for values in intents:
            async with engine.begin() as conn:
                intake = IntakeLedger(conn)
                record = {
                    "actor": values["actor"],
                    "route": values["route"],
                    "idempotency_key": values["idempotency_key"],
                    "request_hash": values["request_hash"],
                    "resource_id": values["operation_id"],
                    "created_at": now,
                }
                if await intake.claim_keys([record]):
                    row_id = await intake.accept_one(
                        values, source_of(values), ACCEPTED_REASON, now, hold=hold
                    )
                    box = (await conn.execute(select(outbox).where(outbox.c.id == row_id))).one()
                    assert box.operation_id == values["operation_id"]
                    claimed.add(values["operation_id"])
    else:
        async with engine.begin() as conn:
            claimed = await IntakeLedger(conn).accept_group(
                [(v, source_of(v)) for v in intents], ACCEPTED_REASON, now
            )
    assert claimed == claimed_by_model

    # Every intent not claimed is judged by the record of its key: a replay
    # of its operation for an equal request, else a conflict.
    async with engine.connect() as conn:
        found = await IntakeLedger(conn).idempotency_records([key_of(v) for v in intents])
    for values in intents:
        if values["operation_id"] in claimed:
            continue
        original = records[key_of(values)]
        record = found[key_of(values)]
        if original["request_hash"] == values["request_hash"]:
            answer = replay_of(record, values["request_hash"], now, DEFAULT_REPLAY_WINDOW)
            assert answer == original["operation_id"]
        else:
            try:
                replay_of(record, values["request_hash"], now, DEFAULT_REPLAY_WINDOW)
            except IdempotencyKeyReused as refusal:
                assert refusal.resource_id == original["operation_id"]
            else:
                raise AssertionError("a different request with a recorded key is a conflict")
        assert key_of(values) in already or any(
            key_of(v) == key_of(values) and v["operation_id"] in claimed for v in intents
        )

    rows = await written(engine, tag)
    wanted = expected_rows(accepted)
    assert rows == wanted
    async with engine.connect() as conn:
        stored = {
            op.operation_id: op
            for op in await conn.execute(
                select(operations).where(operations.c.actor.like(f"{tag}-%"))
            )
        }
    assert set(stored) == {values["operation_id"] for values, _, _ in accepted}
    for values, _, _ in accepted:
        op = stored[values["operation_id"]]
        assert {name: getattr(op, name) for name in values} == values
        assert (op.outcome, op.provider_reference, op.first_attempt_at) == (None, None, None)
