"""Merchant events through the real engine on both databases: written with the
change that causes them (and only then), leased to one attempt at a time per
slot, retried, given up, recorded. The clock is the test's."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.merchant_events import RetrySchedule
from intentledger.domain.states import NextAction, Outcome, State
from intentledger.engine import changes, mandates, webhook_endpoints
from intentledger.engine.announcements import new_event_id
from intentledger.engine.webhook_sender import WebhookSender
from intentledger.service import build_worker
from intentledger.settings import Settings
from intentledger.store.ledger import Ledger
from intentledger.store.tables import merchant_events, webhook_deliveries
from intentledger.store.webhooks import AttemptResult, WebhookStore
from tests.conftest import direct_for
from tests.test_evidence_funnel import (
    AMOUNT,
    SECOND,
    books,
    claim,
    make_mandate,
    pay_under,
    resolve,
)
from tests.test_recovery_model import ControlledClock, Scene
from tests.webhook_receiver import receiving

SCHEDULE = RetrySchedule(timedelta(seconds=10), timedelta(minutes=1), timedelta(minutes=3))


async def add_endpoint(
    engine: AsyncEngine, clock: ControlledClock, actor: str, url: str, events: Any = None
) -> str:
    endpoint_id = webhook_endpoints.new_endpoint_id()
    async with engine.begin() as conn:
        await WebhookStore(conn).insert_endpoint(
            endpoint_id=endpoint_id,
            actor=actor,
            url=url,
            events=events,
            secret=webhook_endpoints.new_secret(),
            created_at=clock(),
        )
    return endpoint_id


async def announced(engine: AsyncEngine) -> list[tuple[str, dict[str, Any]]]:
    """Every event written, in the order it was written (deliveries are serial)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(merchant_events.c.type, merchant_events.c.payload)
            .join(webhook_deliveries, webhook_deliveries.c.event_id == merchant_events.c.event_id)
            .order_by(webhook_deliveries.c.id)
        )
        return [(r.type, json.loads(r.payload)["data"]) for r in rows]


def sender(scene_engine: AsyncEngine, clock: ControlledClock, owner: str = "w1") -> WebhookSender:
    """A sender as `intentledger worker` has it: on PostgreSQL its idle look
    runs on the worker's own connections."""
    return WebhookSender(
        scene_engine,
        clock,
        owner,
        timeout=timedelta(seconds=5),
        in_flight_per_endpoint=4,
        concurrency=16,
        schedule=SCHEDULE,
        allow_private=True,
        jitter=lambda: 0.0,
        direct=direct_for(scene_engine),
    )


async def test_the_idle_look_takes_no_engine_connection_on_postgresql(
    engine: AsyncEngine,
) -> None:
    """Every worker looks for due deliveries a poll's interval apart, work or
    none: on PostgreSQL the look runs on the worker's own connections, and
    finds what is due as the engine's would; on SQLite there are none."""
    clock = ControlledClock()
    checkouts: list[object] = []

    def checked_out(*_: Any) -> None:
        checkouts.append(object())

    with receiving() as receiver:
        endpoint_id = await add_endpoint(engine, clock, "ana", receiver.url)
        webhooks = sender(engine, clock)
        assert (webhooks.direct is not None) == (engine.dialect.name == "postgresql")
        event.listen(engine.sync_engine.pool, "checkout", checked_out)
        try:
            assert await webhooks.start_due(16) == 0
            idle_checkouts = len(checkouts)
        finally:
            event.remove(engine.sync_engine.pool, "checkout", checked_out)
        await pending_deliveries(engine, clock, endpoint_id, 2)
        assert await webhooks.start_due(16) == 2, "the look saw what is due"
        await webhooks.wait_idle()
        await webhooks.aclose()
    assert idle_checkouts == (0 if webhooks.direct is not None else 1)
    assert sorted(r.payload["data"]["id"] for r in receiver.accepted) == ["crd_0", "crd_1"]


async def test_a_worker_gives_its_sender_its_own_connections(engine: AsyncEngine) -> None:
    """`intentledger worker` builds one set of connections for the dispatcher's
    hot path and the sender's look; the worker's `close` closes them, once,
    the look's among them."""
    settings = Settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_url="http://127.0.0.1:9",
    )
    worker = build_worker(settings, engine, ControlledClock(), None)
    try:
        assert worker.webhooks is not None
        direct = worker.dispatcher.direct
        assert worker.webhooks.direct is direct
        assert (direct is not None) == (engine.dialect.name == "postgresql")
        assert await worker.webhooks.start_due(1) == 0
        opened = list(direct._idle) if direct is not None else []
        assert len(opened) == (1 if direct is not None else 0), "the look's connection"
    finally:
        await worker.close()
    assert all(raw.closed for raw in opened)
    if direct is not None:
        assert direct._idle == []
    on_engine = build_worker(settings, engine, ControlledClock(), None, direct=False)
    try:
        assert on_engine.webhooks is not None and on_engine.webhooks.direct is None
    finally:
        await on_engine.close()


async def test_each_change_that_is_news_is_announced_with_what_it_changed(
    engine: AsyncEngine,
) -> None:
    """The funnel's hardest story (a person says failed while the provider's
    success is in flight), seen from the merchant's side."""
    scene = Scene(engine)
    await add_endpoint(engine, scene.clock, "ana", "http://127.0.0.1:9/unused")
    mandate_id = await make_mandate(scene, total_limit=1000)
    op_id = await pay_under(scene, mandate_id, "pay-1")
    scene.provider.submit_behaviour = "lose_after_execute"
    await scene.drain()
    scene.clock.advance(31 * SECOND)
    row = await claim(scene, "reconcile")
    assert await scene.worker.reconciler._begin_check(row) is not None
    lookup = await scene.provider.lookup(op_id)
    await resolve(scene, op_id, Outcome.FAILED)
    await scene.worker.reconciler._record_check(row, lookup)
    assert await books(scene, mandate_id) == (0, AMOUNT)

    events = await announced(engine)
    assert [t for t, _ in events] == [
        "mandate.updated",  # reserved at intake
        "operation.unknown",
        # A person's "failed" frees nothing while the provider is not quiet ...
        "operation.outcome_known",
        "mandate.updated",  # ... and the provider's success books it spent
        "operation.contradicted",
    ]
    mandates = [(d["reserved"], d["spent"]) for t, d in events if t == "mandate.updated"]
    assert mandates == [(AMOUNT, 0), (0, AMOUNT)]
    operations = {t: d for t, d in events if t.startswith("operation.")}
    assert operations["operation.unknown"]["state"] == State.UNKNOWN
    assert operations["operation.outcome_known"]["outcome"] == Outcome.FAILED
    contradicted = operations["operation.contradicted"]
    assert contradicted["outcome_contradicted"] and contradicted["next_action"] == "operator"
    assert contradicted["executed_references"] == [scene.provider.charges[0].id]
    # The representation is GET's, attempts included.
    assert [a["number"] for a in contradicted["attempts"]] == [1]


async def test_a_change_that_rolls_back_announces_nothing(engine: AsyncEngine) -> None:
    scene = Scene(engine)
    await add_endpoint(engine, scene.clock, "alice", "http://127.0.0.1:9/unused")
    op_id = await scene.accept()
    scene.provider.submit_behaviour = "lose_after_execute"
    await scene.drain()
    before = await announced(engine)
    assert [t for t, _ in before] == ["operation.unknown"]

    with pytest.raises(RuntimeError):
        async with engine.begin() as conn:
            ledger = Ledger(conn)
            operation = await ledger.lock_operation(op_id)
            assert operation is not None
            await changes.transition(
                ledger,
                operation,
                State.MANUAL_REVIEW,
                now=scene.clock(),
                next_action=NextAction.OPERATOR,
                reason="escalated, then the transaction failed",
                source="test",
            )
            raise RuntimeError("the unit of work fails after the change")
    assert await announced(engine) == before
    assert (await scene.operation(op_id)).state == State.UNKNOWN


async def test_only_subscribed_endpoints_of_the_objects_actor_get_a_delivery(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    cards_only = await add_endpoint(
        engine, scene.clock, "alice", "http://127.0.0.1:9/a", ["card.updated"]
    )
    everything = await add_endpoint(engine, scene.clock, "alice", "http://127.0.0.1:9/b")
    stranger = await add_endpoint(engine, scene.clock, "bob", "http://127.0.0.1:9/c")
    await scene.accept()
    await scene.drain()  # settles succeeded: news
    async with engine.connect() as conn:
        rows = (
            await conn.execute(
                select(webhook_deliveries.c.endpoint_id, merchant_events.c.type).join(
                    merchant_events, merchant_events.c.event_id == webhook_deliveries.c.event_id
                )
            )
        ).all()
    assert [(r.endpoint_id, r.type) for r in rows] == [(everything, "operation.outcome_known")]
    assert cards_only not in {r.endpoint_id for r in rows}
    assert stranger not in {r.endpoint_id for r in rows}


async def pending_deliveries(
    engine: AsyncEngine, clock: ControlledClock, endpoint_id: str, n: int
) -> None:
    """`n` events for the endpoint's actor, each with one pending delivery."""
    async with engine.begin() as conn:
        for i in range(n):
            event_id = new_event_id()
            await conn.execute(
                merchant_events.insert().values(
                    event_id=event_id,
                    actor="ana",
                    type="card.updated",
                    object_id=f"crd_{i}",
                    payload=json.dumps({"type": "card.updated", "data": {"id": f"crd_{i}"}}),
                    created_at=clock(),
                )
            )
            await conn.execute(
                webhook_deliveries.insert().values(
                    event_id=event_id,
                    actor="ana",
                    endpoint_id=endpoint_id,
                    status="pending",
                    due_at=clock(),
                    attempts=0,
                    created_at=clock(),
                )
            )


async def test_no_endpoint_has_more_attempts_in_flight_than_its_limit_whoever_claims(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    busy = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/busy")
    quiet = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/quiet")
    await pending_deliveries(engine, clock, busy, 40)
    await pending_deliveries(engine, clock, quiet, 2)

    async def claimer(owner: str, limit: int = 2) -> list[str]:
        async with engine.begin() as conn:
            store = WebhookStore(conn)
            claimed = await store.claim_due(clock(), timedelta(minutes=1), owner, limit, 4)
        return [c.endpoint_id for c in claimed]

    # Eight claimers at once, each taking two: without the endpoint's lock each
    # would count the others' uncommitted leases as free slots.
    claims = await asyncio.gather(*(claimer(f"w{i}") for i in range(8)))
    taken = [endpoint for batch in claims for endpoint in batch]
    assert taken.count(busy) == 4, claims
    # The busy endpoint's backlog does not keep the quiet one waiting.
    rest = await claimer("w8", limit=8)
    assert taken.count(quiet) + rest.count(quiet) == 2 and busy not in rest, (claims, rest)
    assert await claimer("w9") == []
    # Leases that run out free their slots (and their rows fall due again).
    # A claim looks at a window of the oldest due rows, which may all be the
    # busy endpoint's; once it is at its limit, the next claim passes it over.
    clock.advance(timedelta(minutes=1, seconds=1))
    again = await claimer("w9", limit=8) + await claimer("w10", limit=8)
    assert sorted(again) == sorted([busy] * 4 + [quiet] * 2)


async def test_down_then_up_every_event_arrives_and_every_failure_is_recorded(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    with receiving() as receiver:
        endpoint_id = await add_endpoint(engine, clock, "ana", receiver.url)
        await pending_deliveries(engine, clock, endpoint_id, 3)
        webhooks = sender(engine, clock)
        receiver.mode = "down"
        for wait in (0, 10, 20):  # the first attempt, then two retries, doubling
            clock.advance(timedelta(seconds=wait))
            assert await webhooks.start_due(16) == 3
            await webhooks.wait_idle()
            assert await webhooks.start_due(16) == 0, "nothing is due before its retry time"
        receiver.mode = "up"
        clock.advance(timedelta(seconds=40))
        assert await webhooks.start_due(16) == 3
        await webhooks.wait_idle()
        await webhooks.aclose()

    assert receiver.refused == 9
    assert sorted(r.payload["data"]["id"] for r in receiver.accepted) == ["crd_0", "crd_1", "crd_2"]
    page = await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert page is not None and not page.has_more
    for delivery in page.deliveries:
        assert delivery.status == "delivered" and delivery.attempts == 4
        history = page.attempts[delivery.id]
        assert [(a.http_status, a.delivered) for a in history] == [(503, False)] * 3 + [(204, True)]
        gaps = [(history[i].next_attempt_at - history[i].at).total_seconds() for i in range(3)]
        assert gaps == [10, 20, 40]
        assert history[-1].next_attempt_at is None


async def test_a_delivery_is_given_up_after_the_horizon_and_stays_listed_as_failed(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    with receiving() as receiver:
        receiver.mode = "down"
        endpoint_id = await add_endpoint(engine, clock, "ana", receiver.url)
        await pending_deliveries(engine, clock, endpoint_id, 1)
        webhooks = sender(engine, clock)
        for _ in range(20):
            if not await webhooks.start_due(16):
                clock.advance(timedelta(seconds=10))
                continue
            await webhooks.wait_idle()
        await webhooks.aclose()
    page = await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert page is not None
    [delivery] = page.deliveries
    assert delivery.status == "failed" and delivery.finished_at is not None
    history = page.attempts[delivery.id]
    assert history[-1].next_attempt_at is None and not history[-1].delivered
    # Within the three-minute horizon: 0, 10, 30, 70, 130 s; the next would pass it.
    assert len(history) == 5


async def test_a_worker_that_dies_mid_attempt_leaves_the_delivery_to_fall_due_again(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/x")
    await pending_deliveries(engine, clock, endpoint_id, 1)
    lease = timedelta(seconds=35)
    async with engine.begin() as conn:
        [first] = await WebhookStore(conn).claim_due(clock(), lease, "dead-worker", 8, 4)
    async with engine.begin() as conn:
        assert await WebhookStore(conn).claim_due(clock(), lease, "w2", 8, 4) == []
    clock.advance(lease + SECOND)
    async with engine.begin() as conn:
        [again] = await WebhookStore(conn).claim_due(clock(), lease, "w2", 8, 4)
    assert again.delivery_id == first.delivery_id
    late = AttemptResult(clock(), 5, 204, None, True, None)
    async with engine.begin() as conn:
        # The dead worker's attempt, recorded late: kept, but the lease is w2's.
        assert not await WebhookStore(conn).record_attempt(first, "dead-worker", late)
        assert await WebhookStore(conn).record_attempt(again, "w2", late)
    page = await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert page is not None
    assert len(page.attempts[first.delivery_id]) == 2
    assert page.deliveries[0].status == "delivered"


async def test_a_private_target_is_refused_at_delivery_unless_allowed(engine: AsyncEngine) -> None:
    clock = ControlledClock()
    with receiving() as receiver:
        endpoint_id = await add_endpoint(engine, clock, "ana", receiver.url)
        await pending_deliveries(engine, clock, endpoint_id, 1)
        strict = sender(engine, clock)
        strict.allow_private = False
        assert await strict.start_due(16) == 1
        await strict.wait_idle()
        await strict.aclose()
    assert receiver.accepted == [] and receiver.refused == 0
    page = await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert page is not None
    [attempt] = page.attempts[page.deliveries[0].id]
    assert attempt.error.startswith("refused: ") and attempt.http_status is None


async def test_deleting_an_endpoint_cancels_what_it_has_not_received(engine: AsyncEngine) -> None:
    clock = ControlledClock()
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/x")
    await pending_deliveries(engine, clock, endpoint_id, 3)
    assert not await webhook_endpoints.delete_endpoint(engine, clock, "bob", endpoint_id)
    assert await webhook_endpoints.delete_endpoint(engine, clock, "ana", endpoint_id)
    async with engine.begin() as conn:
        assert await WebhookStore(conn).claim_due(clock(), timedelta(minutes=1), "w", 8, 4) == []
        statuses = (
            await conn.execute(
                select(webhook_deliveries.c.status, func.count()).group_by(
                    webhook_deliveries.c.status
                )
            )
        ).all()
    assert dict(statuses) == {"cancelled": 3}
    # Its history stays readable to its actor.
    assert await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert await webhook_endpoints.deliveries_page(engine, "bob", endpoint_id, 10, None) is None


async def test_a_delete_that_waits_for_another_of_the_same_endpoint_succeeds(
    engine: AsyncEngine,
) -> None:
    # A client retrying its own slow first DELETE: the retry reads the endpoint
    # live, waits for the first one's lock, and finds it deleted once it may
    # write — which is what it asked for, not a 404.
    clock = ControlledClock()
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/x")
    await pending_deliveries(engine, clock, endpoint_id, 2)
    async with engine.connect() as first:
        transaction = await first.begin()
        assert await WebhookStore(first).delete_endpoint("ana", endpoint_id, clock())
        retry = asyncio.create_task(
            webhook_endpoints.delete_endpoint(engine, clock, "ana", endpoint_id)
        )
        await asyncio.sleep(0.5)
        assert not retry.done(), "the retry waits for the first delete's transaction"
        await transaction.commit()
        assert await retry is True
    read = await webhook_endpoints.read_endpoint(engine, "ana", endpoint_id)
    assert read is not None and read.deleted_at is not None
    assert await webhook_endpoints.read_endpoint(engine, "bob", endpoint_id) is None


async def test_a_delivery_queued_as_its_endpoint_was_deleted_is_cancelled_not_sent(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/x")
    assert await webhook_endpoints.delete_endpoint(engine, clock, "ana", endpoint_id)
    # A change that read the endpoint before the deletion committed queues after it.
    await pending_deliveries(engine, clock, endpoint_id, 1)
    async with engine.begin() as conn:
        assert await WebhookStore(conn).claim_due(clock(), timedelta(minutes=1), "w", 8, 4) == []
    page = await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert page is not None and [d.status for d in page.deliveries] == ["cancelled"]


async def test_an_attempt_that_fails_in_any_way_is_recorded_and_counts(engine: AsyncEngine) -> None:
    clock = ControlledClock()
    # Not a URL any HTTP client takes (DEL inside): stored before the check refused it.
    endpoint_id = await add_endpoint(engine, clock, "ana", "http://127.0.0.1:9/\x7f")
    await pending_deliveries(engine, clock, endpoint_id, 1)
    webhooks = sender(engine, clock)
    assert await webhooks.start_due(16) == 1
    await webhooks.wait_idle()
    await webhooks.aclose()
    page = await webhook_endpoints.deliveries_page(engine, "ana", endpoint_id, 10, None)
    assert page is not None
    [delivery] = page.deliveries
    [attempt] = page.attempts[delivery.id]
    assert delivery.attempts == 1 and delivery.lease_owner is None
    assert attempt.error and not attempt.delivered and attempt.next_attempt_at is not None


async def test_a_mandate_changed_many_times_in_one_transaction_is_one_event(
    engine: AsyncEngine,
) -> None:
    scene = Scene(engine)
    await add_endpoint(engine, scene.clock, "ana", "http://127.0.0.1:9/x")
    mandate_id = await make_mandate(scene, total_limit=5000)
    paid = [await pay_under(scene, mandate_id, f"pay-{i}") for i in range(3)]
    before = len(await announced(engine))
    keyed = mandates.Keyed("ana", "POST /v1/mandates/{id}/suspend", "suspend-1", "h")
    await mandates.change_status(engine, scene.clock, keyed, mandate_id, "suspend")
    events = (await announced(engine))[before:]
    updates = [d for t, d in events if t == "mandate.updated"]
    assert len(updates) == 1, events
    assert (updates[0]["status"], updates[0]["reserved"]) == ("suspended", 0)
    cancelled = sorted(d["id"] for t, d in events if t == "operation.outcome_known")
    assert cancelled == sorted(paid)
    assert all(d["state"] == "CANCELLED" for t, d in events if t == "operation.outcome_known")


async def test_an_equal_retry_of_a_creation_is_answered_before_any_lookup(
    engine: AsyncEngine,
) -> None:
    clock = ControlledClock()
    keyed = mandates.Keyed("ana", webhook_endpoints.CREATE_ROUTE, "k", "hash")

    async def public(_host: str, _port: int) -> list[str]:
        return ["8.8.8.8"]

    async def broken(_host: str, _port: int) -> list[str]:
        raise OSError("the name server is down")

    url = "https://hooks.example.com/in"
    created = await webhook_endpoints.create_endpoint(
        engine, clock, keyed, url, None, False, public
    )
    again = await webhook_endpoints.create_endpoint(engine, clock, keyed, url, None, False, broken)
    assert again.replayed and again.endpoint.secret == created.endpoint.secret
    with pytest.raises(webhook_endpoints.EndpointRefused, match="does not resolve"):
        other = mandates.Keyed("ana", webhook_endpoints.CREATE_ROUTE, "k2", "hash2")
        await webhook_endpoints.create_endpoint(engine, clock, other, url, None, False, broken)


async def test_an_actor_has_at_most_sixteen_endpoints(engine: AsyncEngine) -> None:
    clock = ControlledClock()
    for i in range(webhook_endpoints.MAX_ENDPOINTS_PER_ACTOR):
        keyed = mandates.Keyed("ana", webhook_endpoints.CREATE_ROUTE, f"k{i}", f"h{i}")
        await webhook_endpoints.create_endpoint(
            engine, clock, keyed, f"https://8.8.8.8/{i}", None, False
        )
    keyed = mandates.Keyed("ana", webhook_endpoints.CREATE_ROUTE, "one-more", "h-more")
    with pytest.raises(webhook_endpoints.EndpointRefused) as refused:
        await webhook_endpoints.create_endpoint(
            engine, clock, keyed, "https://8.8.8.8/x", None, False
        )
    assert refused.value.slug == "webhook-endpoint-limit"
    # Another actor is not held to ana's count.
    keyed = mandates.Keyed("bob", webhook_endpoints.CREATE_ROUTE, "k", "h")
    await webhook_endpoints.create_endpoint(engine, clock, keyed, "https://8.8.8.8/x", None, False)
