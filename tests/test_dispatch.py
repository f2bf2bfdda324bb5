"""The dispatcher against a real sandbox server over loopback, on both databases."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.domain.retention import sandbox_policy
from intentledger.domain.safety import SafetyRules
from intentledger.engine import intake
from intentledger.engine.dispatcher import Dispatcher, DispatchSettings
from intentledger.engine.intake import Intent
from intentledger.engine.reconciler import Reconciler
from intentledger.engine.settlement_queue import DEFAULT_WINDOW
from intentledger.engine.sweeper import Sweeper
from intentledger.engine.worker import Worker
from intentledger.ports import free_port
from intentledger.providers.sandbox_client import SandboxProvider
from intentledger.store.ledger import Ledger
from intentledger.store.tables import decisions, observations, operations, outbox
from tests.conftest import direct_for

ROUTE = "POST /v1/payments"


class MovableClock:
    """Real time plus an offset the test can advance (leases, due times)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def __call__(self) -> datetime:
        return datetime.now(UTC) + self.offset

    def advance(self, delta: timedelta) -> None:
        self.offset += delta


def make_worker(
    engine: AsyncEngine,
    provider_url: str,
    clock: Any,
    *,
    timeout: float = 1.0,
    lease: timedelta = timedelta(minutes=5),
    worker: str = "test-worker",
    backoff: timedelta = timedelta(seconds=30),
    retention: timedelta = timedelta(hours=24),
    rules: SafetyRules | None = None,
    record_window: timedelta = DEFAULT_WINDOW,
) -> Worker:
    """A worker wired as `intentledger worker` wires it, with a test clock."""
    provider = SandboxProvider(provider_url, timedelta(seconds=timeout))
    return Worker(
        engine,
        clock,
        lease,
        worker,
        Dispatcher(
            engine,
            provider,
            clock,
            DispatchSettings(lease=lease, recheck_backoff=backoff),
            worker,
            jitter=lambda: 0.0,
            direct=direct_for(engine),
        ),
        Reconciler(
            engine,
            provider,
            clock,
            backoff,
            lambda _p: sandbox_policy(retention),
            lambda _p: rules or SafetyRules(),
            worker,
            jitter=lambda: 0.0,
        ),
        Sweeper(engine, clock, timedelta(minutes=2), backoff, worker, jitter=lambda: 0.0),
        record_window=record_window,
    )


async def accept(
    engine: AsyncEngine, clock: Any, payment_method: str, key: str | None = None
) -> str:
    body = {"amount": 500, "currency": "EUR", "payment_method": payment_method, "metadata": {}}
    intent = Intent(
        actor="alice",
        route=ROUTE,
        idempotency_key=key or f"key-{payment_method}-{time.time_ns()}",
        request_hash=request_hash("alice", ROUTE, body),
        body=body,
        provider="sandbox",
    )
    result = await intake.accept(engine, clock, intent)
    return str(result.operation["operation_id"])


async def operation(engine: AsyncEngine, operation_id: str) -> Any:
    async with engine.connect() as conn:
        return await Ledger(conn).get_operation(operation_id)


async def rows(engine: AsyncEngine, table: Any, operation_id: str) -> list[Any]:
    async with engine.connect() as conn:
        result = await conn.execute(
            select(table).where(table.c.operation_id == operation_id).order_by(table.c.id)
        )
        return list(result.all())


def sandbox_charges(sandbox: str, reference: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = httpx.get(
        f"{sandbox}/charges", params={"reference": reference}
    ).json()["data"]
    return data


def sandbox_submits(sandbox: str, reference: str) -> list[dict[str, Any]]:
    data = httpx.get(f"{sandbox}/requests", params={"reference": reference}).json()["data"]
    return [r for r in data if r["kind"] == "submit"]


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


async def drain(worker: Worker) -> int:
    return await worker.drain()


async def test_ok_payment_is_submitted_once_and_succeeds(engine: AsyncEngine, sandbox: str) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok")
    assert await drain(make_worker(engine, sandbox, clock)) == 1
    op = await operation(engine, op_id)
    assert (op.state, op.outcome, op.next_action) == ("OUTCOME_KNOWN", "succeeded", "none")
    assert op.provider_reference and op.provider_reference.startswith("ch_")
    assert op.first_attempt_at is not None
    assert len(sandbox_charges(sandbox, op_id)) == 1
    [pending] = [r for r in await rows(engine, outbox, op_id) if r.done_at is None] or [None]
    assert pending is None


async def test_decline_is_a_known_failure_with_no_charge(engine: AsyncEngine, sandbox: str) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_declined")
    await drain(make_worker(engine, sandbox, clock))
    op = await operation(engine, op_id)
    assert (op.state, op.outcome) == ("OUTCOME_KNOWN", "failed")
    assert sandbox_charges(sandbox, op_id) == []
    [result] = [o for o in await rows(engine, observations, op_id) if o.kind == "submit_result"]
    assert (result.http_status, result.verdict) == (402, "failed")


async def test_lost_answer_is_unknown_never_failed_never_resent(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_timeout_after_execute")
    worker = make_worker(engine, sandbox, clock, timeout=0.5)
    await drain(worker)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome, op.next_action) == ("UNKNOWN", None, "reconcile")
    assert op.retry_after_at is not None and op.retry_after_at > op.last_observed_at
    [result] = [o for o in await rows(engine, observations, op_id) if o.kind == "submit_result"]
    assert (result.transport, result.error_class, result.verdict) == (
        "no_response",
        "aiohttp.SocketTimeoutError",
        "unknown",
    )
    assert len(sandbox_charges(sandbox, op_id)) == 1
    # Before its check is due nothing happens; then a lookup, not a resend, settles it.
    assert await drain(worker) == 0
    clock.advance(timedelta(seconds=31))
    assert await drain(worker) == 1
    assert len(sandbox_submits(sandbox, op_id)) == 1
    op = await operation(engine, op_id)
    assert (op.state, op.outcome, op.reconciliation_status) == (
        "OUTCOME_KNOWN",
        "succeeded",
        "found_succeeded",
    )


async def test_withheld_answer_before_execution_is_unknown(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_timeout_before_execute")
    await drain(make_worker(engine, sandbox, clock, timeout=0.5))
    assert (await operation(engine, op_id)).state == "UNKNOWN"
    assert sandbox_charges(sandbox, op_id) == []


async def test_unavailable_is_unknown_until_its_retry_after(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_unavailable")
    # A backoff shorter than the provider's Retry-After, so the header decides.
    await drain(make_worker(engine, sandbox, clock, backoff=timedelta(milliseconds=100)))
    op = await operation(engine, op_id)
    [result] = [o for o in await rows(engine, observations, op_id) if o.kind == "submit_result"]
    assert (op.state, op.next_action, result.http_status) == ("UNKNOWN", "reconcile", 503)
    assert result.retry_after_raw == "2"
    assert result.retry_after_at == result.at + timedelta(seconds=2)
    assert op.retry_after_at == result.at + timedelta(seconds=2)
    assert sandbox_charges(sandbox, op_id) == []


async def test_rate_limited_is_sent_again_no_earlier_than_retry_after(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_rate_limited")
    worker = make_worker(engine, sandbox, clock)
    assert await drain(worker) == 1
    op = await operation(engine, op_id)
    [refused] = [o for o in await rows(engine, observations, op_id) if o.kind == "submit_result"]
    assert (op.state, op.next_action, refused.http_status) == ("ACCEPTED", "submit", 429)
    assert op.retry_after_at == refused.at + timedelta(seconds=1)
    assert await drain(worker) == 0  # not yet due
    deadline = time.monotonic() + 10
    while (await operation(engine, op_id)).state != "OUTCOME_KNOWN":
        assert time.monotonic() < deadline, "the rate-limited payment was never sent again"
        await drain(worker)
    assert len(sandbox_charges(sandbox, op_id)) == 1
    _first, second = sandbox_submits(sandbox, op_id)
    assert parse_time(second["received_at"]) >= refused.at + timedelta(seconds=1)
    # The second attempt is authorised by a decision citing the 429.
    [decision] = await rows(engine, decisions, op_id)
    assert decision.rule == "non_execution_evidence" and decision.next_action == "submit"
    async with engine.connect() as conn:
        attempts = await Ledger(conn).attempts_of(op_id)
    assert [(a.number, a.relation, a.resubmission_of, a.decision_id) for a in attempts] == [
        (1, "original", None, None),
        (2, "resubmission", 1, decision.id),
    ]
    assert attempts[0].provider_idempotency_key == attempts[1].provider_idempotency_key


async def test_connection_refused_is_recorded_as_not_sent(engine: AsyncEngine) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok")
    stopped_provider = f"http://127.0.0.1:{free_port()}/_sandbox"
    await drain(make_worker(engine, stopped_provider, clock))
    op = await operation(engine, op_id)
    [result] = [o for o in await rows(engine, observations, op_id) if o.kind == "submit_result"]
    assert (result.transport, result.error_class, result.verdict) == (
        "not_sent",
        "aiohttp.ClientConnectorError",
        "not_executed",
    )
    assert (op.state, op.next_action, op.outcome) == ("ACCEPTED", "submit", None)
    [decision] = await rows(engine, decisions, op_id)
    assert decision.rule == "non_execution_evidence"
    pending = [r for r in await rows(engine, outbox, op_id) if r.done_at is None]
    assert len(pending) == 1 and pending[0].decision_id == decision.id


async def test_resumed_delivery_marks_unknown_without_calling_the_provider(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok")
    first = make_worker(engine, sandbox, clock, lease=timedelta(seconds=30), worker="first")
    async with engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(clock(), timedelta(seconds=30), "first")
    assert row is not None
    submission = await first.dispatcher._pre_submit(row)  # committed SUBMITTING, then "dies"
    assert submission is not None
    assert (await operation(engine, op_id)).state == "SUBMITTING"

    clock.advance(timedelta(seconds=31))
    second = make_worker(engine, sandbox, clock, worker="second")
    assert await drain(second) == 1
    op = await operation(engine, op_id)
    assert (op.state, op.next_action) == ("UNKNOWN", "reconcile")
    assert sandbox_submits(sandbox, op_id) == []
    kinds = [o.kind for o in await rows(engine, observations, op_id)]
    assert kinds == ["resumed_submitting"]

    # The first worker's answer arrives late: recorded, and it settles the operation.
    answer = await first.dispatcher.provider.submit(submission.request)
    await first.dispatcher.record(row, submission, answer)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome) == ("OUTCOME_KNOWN", "succeeded")
    assert len(sandbox_charges(sandbox, op_id)) == 1


async def test_a_lost_lease_stops_the_old_holder_before_it_submits(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok")
    slow = make_worker(engine, sandbox, clock, lease=timedelta(seconds=5), worker="slow")
    async with engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(clock(), timedelta(seconds=5), "slow")
    clock.advance(timedelta(seconds=6))
    assert await drain(make_worker(engine, sandbox, clock, worker="fast")) == 1
    assert await slow.dispatcher._pre_submit(row) is None
    assert len(sandbox_submits(sandbox, op_id)) == 1
    assert (await operation(engine, op_id)).outcome == "succeeded"


async def test_slow_answer_within_the_timeout_succeeds(engine: AsyncEngine, sandbox: str) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_slow")
    await drain(make_worker(engine, sandbox, clock, timeout=5))
    assert (await operation(engine, op_id)).outcome == "succeeded"


@pytest.mark.parametrize("payment_method", ["pm_ok", "pm_declined", "pm_timeout_after_execute"])
async def test_every_result_is_one_transaction_with_its_transition(
    engine: AsyncEngine, sandbox: str, payment_method: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, payment_method)
    await drain(make_worker(engine, sandbox, clock, timeout=0.5))
    async with engine.connect() as conn:
        events = await Ledger(conn).events_of(op_id)
        op = (
            await conn.execute(select(operations).where(operations.c.operation_id == op_id))
        ).one()
    transitions = [row for kind, row in events if kind == "transition"]
    assert [t.to_state for t in transitions] == ["ACCEPTED", "SUBMITTING", op.state]
    [result] = [row for kind, row in events if kind == "observation"]
    assert transitions[-1].at == result.at  # written by the same record transaction
    assert op.version == 3
