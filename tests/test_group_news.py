"""A group record's news costs the same statements however many payments it
settles, and says what one record at a time would say.

A merchant with a webhook endpoint turned every payment a group record settled
into four reads and two inserts inside the group's transaction: a group of 20
went from 3 statements to 123 (docs/benchmarks.md, "News in a group record,
and the merchant webhooks' sender").
On both databases, with answers handed to the group record directly (no
provider is called): the statements of groups of two sizes are counted, and
every event is held to what GET shows for its object once the group committed.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.documents import json_value, mandate_document, operation_document
from intentledger.domain.canonical import request_hash
from intentledger.domain.transport import Classification, ProviderAnswer, Transport, Verdict
from intentledger.engine import mandates, queries
from intentledger.engine.batch_dispatch import pre_submit
from intentledger.engine.intake import Intent, accept
from intentledger.engine.settlement_queue import Sent, answered_now, record_together
from intentledger.store import ids as id_lists
from intentledger.store.batches import BatchLedger
from intentledger.store.ledger import Ledger
from intentledger.store.tables import merchant_events, webhook_deliveries
from intentledger.store.webhooks import WebhookStore
from tests.support import counting
from tests.test_dispatch import ROUTE
from tests.test_merchant_webhooks_engine import add_endpoint
from tests.test_recovery_model import SECOND, Scene
from tests.test_refunds_engine import paid, refund

LEASE = timedelta(minutes=5)


def success(reference: str) -> ProviderAnswer:
    return ProviderAnswer(
        Transport.RESPONSE,
        status=200,
        provider_reference=reference,
        detail={"id": reference, "status": "succeeded"},
        mapped=Classification(Verdict.SUCCEEDED, "charge succeeded"),
    )


async def pay(scene: Scene, actor: str, key: str, mandate_id: str | None = None) -> str:
    body: dict[str, Any] = {
        "amount": 500,
        "currency": "EUR",
        "payment_method": "pm_model",
        "metadata": {},
    }
    if mandate_id is not None:
        body["mandate_id"] = mandate_id
    intent = Intent(actor, ROUTE, key, request_hash(actor, ROUTE, body), body, "sandbox")
    return str((await accept(scene.engine, scene.clock, intent)).operation["operation_id"])


async def mandate(scene: Scene, actor: str, key: str) -> str:
    keyed = mandates.Keyed(actor, mandates.CREATE_ROUTE, key, f"hash-{key}")
    made, _ = await mandates.create_mandate(
        scene.engine,
        scene.clock,
        keyed,
        {"currency": "EUR", "max_amount": 1000, "total_limit": 100_000},
    )
    return str(made.mandate_id)


async def settle_as_a_group(scene: Scene, count: int) -> int:
    """Claim and pre-submit the `count` due payments, settle them all in one group
    record with a success each; the statements the group record sent."""
    async with scene.engine.begin() as conn:
        rows = await BatchLedger(conn).claim_outbox_rows(
            scene.clock(), LEASE, scene.worker.worker_id, count
        )
    assert len(rows) == count
    prepared, others = await pre_submit(scene.worker.dispatcher, rows)
    assert len(prepared) == count and not others
    sent = [
        Sent(item, success(f"ch_{item.row.operation_id[-10:]}"), answered_now())
        for item in prepared
    ]
    statements, stop = counting(scene.engine)
    try:
        settled = await record_together(scene.worker.dispatcher, sent)
    finally:
        stop()
    assert len(settled) == count
    return len(statements)


async def announced(engine: AsyncEngine) -> list[tuple[str, str, str, dict[str, Any]]]:
    """Every delivery written, in order: its endpoint, its event's type, object
    and data."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(
                webhook_deliveries.c.endpoint_id,
                merchant_events.c.type,
                merchant_events.c.object_id,
                merchant_events.c.payload,
            )
            .join(merchant_events, webhook_deliveries.c.event_id == merchant_events.c.event_id)
            .order_by(webhook_deliveries.c.id)
        )
        return [(r.endpoint_id, r.type, r.object_id, json.loads(r.payload)["data"]) for r in rows]


async def shown(engine: AsyncEngine, operation_id: str) -> dict[str, Any]:
    """The operation's document as GET answers it."""
    view = await queries.operation_view(engine, operation_id)
    assert view is not None
    document = operation_document(view.operation, view.attempts, view.submit_results, view.refunds)
    decoded: dict[str, Any] = json.loads(json.dumps(document))
    return decoded


async def test_a_group_announces_each_settled_payment_in_statements_its_size_does_not_change(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    everything = await add_endpoint(engine, scene.clock, "alice", "http://127.0.0.1:9/all")
    outcomes = await add_endpoint(
        engine, scene.clock, "alice", "http://127.0.0.1:9/o", ["operation.outcome_known"]
    )
    # Takes none of a settlement's news: no delivery of it.
    await add_endpoint(engine, scene.clock, "alice", "http://127.0.0.1:9/u", ["operation.unknown"])
    # Another merchant's endpoint hears nothing of alice's payments (nor of
    # carol's, who has none).
    await add_endpoint(engine, scene.clock, "bob", "http://127.0.0.1:9/bob")

    async def group(actor: str, count: int) -> tuple[int, list[str]]:
        paying = [await pay(scene, actor, f"{actor}-{count}-{i}") for i in range(count)]
        return await settle_as_a_group(scene, count), paying

    # The news's statements: a group's with an endpoint listening less the
    # same group's for a merchant with none (SQLite's own writes of a group
    # are not one statement per table, PostgreSQL's are).
    small_statements, small = await group("alice", 2)
    small_statements -= (await group("carol", 2))[0]
    large_statements, large = await group("alice", 7)
    large_statements -= (await group("carol", 7))[0]
    assert large_statements == small_statements
    deliveries = await announced(engine)
    # In the order the group settled them (its claim's), each event's
    # deliveries together, by endpoint id: as one change at a time wrote them.
    assert [(endpoint, object_id) for endpoint, _, object_id, _ in deliveries] == [
        (endpoint, op_id) for op_id in small + large for endpoint in sorted((everything, outcomes))
    ]
    async with engine.connect() as conn:
        stamped = (
            await conn.execute(
                select(
                    merchant_events.c.object_id,
                    merchant_events.c.created_at,
                    merchant_events.c.payload,
                )
            )
        ).all()
    for object_id, created_at, payload in stamped:
        settled_at = (await shown(engine, object_id))["updated_at"]
        # The event is the group record's: written, and stamped, at its instant.
        assert json.loads(payload)["timestamp"] == settled_at
        assert json_value(created_at) == settled_at
    for _, event_type, object_id, data in deliveries:
        assert event_type == "operation.outcome_known"
        assert data == await shown(engine, object_id)
        assert data["state"] == "OUTCOME_KNOWN" and data["attempts"][0]["verdict"] == "succeeded"


async def test_a_group_announces_each_mandate_once_in_statements_its_size_does_not_change(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    listening = await add_endpoint(engine, scene.clock, "ana", "http://127.0.0.1:9/ana")
    deleted = await add_endpoint(engine, scene.clock, "ana", "http://127.0.0.1:9/gone")
    async with engine.begin() as conn:
        assert await WebhookStore(conn).delete_endpoint("ana", deleted, scene.clock())
    held = [await mandate(scene, "ana", f"md-{i}") for i in range(4)]
    # Bea has mandates too, and no endpoint.
    silent = [await mandate(scene, "bea", f"md-{i}") for i in range(4)]

    async def group_news(
        actor: str, under: list[str]
    ) -> tuple[int, list[str], list[tuple[str, str, str, dict[str, Any]]]]:
        """Pay under each of `under` and settle them as one group: the
        statements, the payments, and what the group record announced."""
        paying = [await pay(scene, actor, f"key-{len(under)}-{i}", m) for i, m in enumerate(under)]
        before = len(await announced(engine))
        statements = await settle_as_a_group(scene, len(under))
        news = (await announced(engine))[before:]
        # Each mandate as the group left it.
        async with engine.connect() as conn:
            for _, event_type, object_id, data in news:
                if event_type == "mandate.updated":
                    found = await Ledger(conn).get_mandate(object_id)
                    assert found is not None
                    assert data == json.loads(json.dumps(mandate_document(found)))
        return statements, paying, news

    # The news's statements, as in the test above.
    small_statements, small, small_news = await group_news("ana", held[:2])
    small_statements -= (await group_news("bea", silent[:2]))[0]
    # Two payments under one mandate in one group: one event shows both spent.
    large_statements, large, large_news = await group_news("ana", [held[0], *held])
    large_statements -= (await group_news("bea", [silent[0], *silent]))[0]

    assert large_statements == small_statements
    for paying, news, spent in (
        (small, small_news, {held[0]: 500, held[1]: 500}),
        (large, large_news, {held[0]: 1500, held[1]: 1000, held[2]: 500, held[3]: 500}),
    ):
        assert {endpoint for endpoint, *_ in news} == {listening}
        updated = {object_id: data for _, t, object_id, data in news if t == "mandate.updated"}
        assert len(updated) == len([t for _, t, *_ in news if t == "mandate.updated"])
        assert {object_id: data["spent"] for object_id, data in updated.items()} == spent
        outcomes = [(o, d) for _, t, o, d in news if t == "operation.outcome_known"]
        assert sorted(o for o, _ in outcomes) == sorted(paying)
        for object_id, data in outcomes:
            assert data == await shown(engine, object_id)


@pytest.mark.parametrize("per_read", [1, 2, id_lists.IDS_PER_READ])
async def test_parts_of_many_are_each_operations_parts_read_alone(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, per_read: int
) -> None:
    monkeypatch.setattr(id_lists, "IDS_PER_READ", per_read)
    scene = Scene(engine)
    refunded = await paid(scene)
    refunds = [await refund(scene, refunded, f"r-{i}", 100) for i in range(2)]
    await scene.drain()
    scene.provider.submit_behaviour = "lose_before_execute"
    retried = await scene.accept_with_key("retried")
    await scene.drain()
    scene.provider.submit_behaviour = "ok"
    scene.clock.advance(31 * SECOND)
    await scene.drain()  # not found -> the same key again -> executes
    plain = await scene.accept_with_key("plain")
    await scene.drain()
    accepted = await scene.accept_with_key("accepted")
    ids = [refunded, *refunds, retried, plain, accepted]

    async with engine.connect() as conn:
        ledger = Ledger(conn)
        parts = await BatchLedger(conn).parts_of([*ids, "op_missing", refunded])
        assert sorted(parts) == sorted(ids)
        for op_id in ids:
            alone = await ledger.get_operation(op_id)
            assert alone is not None
            got = parts[op_id]
            assert got.operation == alone
            assert got.attempts == await ledger.attempts_of(op_id)
            assert got.submit_results == await ledger.submit_results_of(op_id)
            assert got.refunds == (
                await ledger.refunds_of(op_id) if alone.kind == "payment" else []
            )
    assert len(parts[retried].attempts) == 2 and len(parts[retried].submit_results) == 2
    assert sorted(r.operation_id for r in parts[refunded].refunds) == sorted(refunds)
    assert parts[accepted].attempts == []
