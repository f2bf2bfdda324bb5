"""Recovery against the real sandbox: reconciliation, safety review, sweeper."""

from __future__ import annotations

import asyncio
import subprocess
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.retention import REGISTRY, sandbox_policy
from intentledger.domain.safety import SafetyRules
from intentledger.domain.states import Outcome
from intentledger.engine.operator import (
    OperatorAction,
    approve_resubmission,
    escalate,
    perform,
    resolve,
)
from intentledger.engine.worker import Worker
from intentledger.store.ledger import Ledger
from intentledger.store.tables import decisions, observations, observations_with_detail
from tests.support import INTENTLEDGER
from tests.test_dispatch import (
    MovableClock,
    accept,
    make_worker,
    operation,
    rows,
    sandbox_charges,
    sandbox_submits,
)


async def run_checks(worker: Worker, clock: MovableClock, step: timedelta, rounds: int) -> None:
    """Let `rounds` check intervals pass, delivering whatever falls due."""
    for _ in range(rounds):
        await worker.drain()
        clock.advance(step)
    await worker.drain()


async def attempts(engine: AsyncEngine, op_id: str) -> list[Any]:
    async with engine.connect() as conn:
        return list(await Ledger(conn).attempts_of(op_id))


async def test_lost_answer_settled_by_lookup_without_a_resend(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_timeout_after_execute")
    worker = make_worker(engine, sandbox, clock, timeout=0.5)
    await run_checks(worker, clock, timedelta(seconds=31), 1)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome, op.reconciliation_status) == (
        "OUTCOME_KNOWN",
        "succeeded",
        "found_succeeded",
    )
    assert op.provider_reference == sandbox_charges(sandbox, op_id)[0]["id"]
    [lookup] = [o for o in await rows(engine, observations, op_id) if o.kind == "lookup_result"]
    assert lookup.verdict == "found_succeeded"
    assert len(sandbox_submits(sandbox, op_id)) == 1 and len(await attempts(engine, op_id)) == 1


async def test_not_found_inside_retention_is_a_recorded_same_key_replay(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_timeout_before_execute")
    worker = make_worker(engine, sandbox, clock, timeout=0.5)
    await run_checks(worker, clock, timedelta(seconds=31), 1)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome) == ("OUTCOME_KNOWN", "succeeded")
    assert len(sandbox_charges(sandbox, op_id)) == 1
    first, second = await attempts(engine, op_id)
    [decision] = await rows(engine, decisions, op_id)
    assert decision.rule == "replay_within_retention" and decision.next_action == "resubmit"
    assert (second.relation, second.resubmission_of, second.decision_id) == (
        "resubmission",
        1,
        decision.id,
    )
    assert second.provider_idempotency_key == first.provider_idempotency_key
    assert decision.key_age_at_decision is not None
    assert decision.inputs["policy"]["provider_api"] == "sandbox"
    assert op.provider_retention_note and "sandbox" in op.provider_retention_note
    assert op.key_age_at_decision == decision.key_age_at_decision


@pytest.mark.parametrize(
    ("api", "replays_at", "stops_at"),
    [
        ("stripe-v1", timedelta(hours=21, minutes=30), timedelta(hours=21, minutes=36)),
        ("mollie", timedelta(minutes=53, seconds=50), timedelta(minutes=54)),
    ],
)
async def test_retention_boundary_replays_below_and_stops_at_the_bound(
    engine: AsyncEngine, sandbox: str, api: str, replays_at: timedelta, stops_at: timedelta
) -> None:
    policy = REGISTRY[api]
    for age, expected in ((replays_at, "OUTCOME_KNOWN"), (stops_at, "MANUAL_REVIEW")):
        clock = MovableClock()
        op_id = await accept(engine, clock, "pm_timeout_before_execute")
        worker = make_worker(engine, sandbox, clock, timeout=0.5)
        worker.reconciler.policy_for = lambda _p: policy
        await worker.drain()  # first attempt: lost
        clock.advance(age)  # the first check happens this long after the key's first use
        await worker.drain()
        op = await operation(engine, op_id)
        assert op.state == expected, age
        [decision] = await rows(engine, decisions, op_id)
        age_at_decision = decision.key_age_at_decision
        assert age <= age_at_decision < age + timedelta(seconds=5)
        if expected == "MANUAL_REVIEW":
            assert (decision.rule, op.next_action) == ("retention_passed", "operator")
            assert len(sandbox_submits(sandbox, op_id)) == 1  # never sent again
        else:
            assert len(sandbox_submits(sandbox, op_id)) == 2
        assert api in op.provider_retention_note


async def test_a_replay_whose_window_closes_before_sending_is_not_sent(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_timeout_before_execute")
    worker = make_worker(engine, sandbox, clock, timeout=0.5, retention=timedelta(hours=1))
    await worker.drain()
    clock.advance(timedelta(minutes=53))
    # Run only the check, so the replay it orders waits in the outbox.
    assert await worker.deliver_next()
    assert (await operation(engine, op_id)).next_action == "resubmit"
    clock.advance(timedelta(minutes=2))  # a backlog: now past 54 min (1 h less 10 %)
    await worker.drain()
    op = await operation(engine, op_id)
    rules = [d.rule for d in await rows(engine, decisions, op_id)]
    assert rules[:2] == ["replay_within_retention", "replay_window_closed"]
    assert len(sandbox_submits(sandbox, op_id)) == 1
    clock.advance(timedelta(minutes=1))
    await worker.drain()
    op = await operation(engine, op_id)
    assert (op.state, op.next_action) == ("MANUAL_REVIEW", "operator")
    assert [d.rule for d in await rows(engine, decisions, op_id)][-1] == "retention_passed"
    assert len(sandbox_submits(sandbox, op_id)) == 1


async def test_blackhole_ends_with_a_person_and_no_charge(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_blackhole")
    worker = make_worker(
        engine,
        sandbox,
        clock,
        timeout=0.3,
        retention=timedelta(seconds=3),
        backoff=timedelta(milliseconds=500),
    )
    await run_checks(worker, clock, timedelta(seconds=1), 6)
    op = await operation(engine, op_id)
    assert (op.state, op.next_action, op.outcome) == ("MANUAL_REVIEW", "operator", None)
    assert sandbox_charges(sandbox, op_id) == []
    lookups = [o for o in await rows(engine, observations, op_id) if o.kind == "lookup_result"]
    assert lookups and all(o.verdict == "lookup_failed" for o in lookups)


async def test_checks_exhausted_goes_to_manual_review(engine: AsyncEngine, sandbox: str) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_blackhole")
    worker = make_worker(
        engine,
        sandbox,
        clock,
        timeout=0.2,
        rules=SafetyRules(max_checks=2),
        backoff=timedelta(seconds=1),
    )
    await run_checks(worker, clock, timedelta(seconds=5), 5)
    op = await operation(engine, op_id)
    assert op.state == "MANUAL_REVIEW"
    assert [d.rule for d in await rows(engine, decisions, op_id)][-1] == "checks_exhausted"


async def test_sweeper_turns_stale_submitting_into_unknown_without_a_call(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok")
    worker = make_worker(engine, sandbox, clock, lease=timedelta(hours=1))
    async with engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(clock(), timedelta(hours=1), "test-worker")
    assert await worker.dispatcher._pre_submit(row) is not None  # then the caller "dies"
    assert await worker.sweeper.sweep() == 0  # not stale yet
    clock.advance(timedelta(minutes=2, seconds=1))
    assert await worker.sweeper.sweep() == 1
    op = await operation(engine, op_id)
    assert (op.state, op.next_action) == ("UNKNOWN", "reconcile")
    assert sandbox_submits(sandbox, op_id) == []
    assert [o.kind for o in await rows(engine, observations, op_id)] == ["sweeper"]
    # Its check finds nothing, and the replay the review orders executes once.
    clock.advance(timedelta(seconds=31))
    await worker.drain()
    assert (await operation(engine, op_id)).outcome == "succeeded"
    assert len(sandbox_charges(sandbox, op_id)) == 1


async def test_two_executed_attempts_are_flagged_as_a_duplicate(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_lookup_lag")
    worker = make_worker(engine, sandbox, clock, timeout=0.5, retention=timedelta(minutes=1))
    await worker.drain()  # executed; the answer is lost
    clock.advance(timedelta(seconds=60))
    await worker.drain()  # the lookup lags: not found, and the key is too old to replay
    assert (await operation(engine, op_id)).state == "MANUAL_REVIEW"
    action = OperatorAction(op_id, "olive", "dashboard search showed nothing")
    await perform(
        engine,
        clock,
        lambda ledger, now: approve_resubmission(
            ledger, now, action, lambda _p: sandbox_policy(timedelta(hours=24))
        ),
    )
    await worker.drain()  # the new-key request executes a second time
    op = await operation(engine, op_id)
    assert (op.state, op.outcome, op.duplicate_detected) == ("OUTCOME_KNOWN", "succeeded", False)
    assert len(sandbox_charges(sandbox, op_id)) == 2
    await asyncio.sleep(3.1)  # the sandbox's lookup lag passes
    clock.advance(timedelta(seconds=31))
    await worker.drain()  # the audit lookup counts both charges
    op = await operation(engine, op_id)
    assert op.duplicate_detected is True
    [audit] = [
        o for o in await rows(engine, observations_with_detail, op_id) if o.kind == "audit_lookup"
    ]
    assert len(audit.detail["charges"]) == 2


async def test_an_operator_escalates_an_unknown_payment(
    engine: AsyncEngine, database_url: str, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_timeout_before_execute")
    await make_worker(engine, sandbox, clock, timeout=0.3).drain()
    assert (await operation(engine, op_id)).state == "UNKNOWN"
    done = subprocess.run(
        [
            *INTENTLEDGER,
            "ops",
            "escalate",
            op_id,
            "--reason",
            "customer called",
            "--by",
            "olive",
            "--database-url",
            database_url,
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    op = await operation(engine, op_id)
    assert (op.state, op.next_action) == ("MANUAL_REVIEW", "operator")
    [decision] = await rows(engine, decisions, op_id)
    assert (decision.rule, decision.source) == ("operator_escalation", "operator:cli:olive")
    again = subprocess.run(
        [*INTENTLEDGER, "ops", "escalate", op_id, "--database-url", database_url],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 1 and "cannot escalate" in again.stderr
    # The check that was due finds it with a person and leaves it there.
    clock.advance(timedelta(minutes=1))
    await make_worker(engine, sandbox, clock).drain()
    assert (await operation(engine, op_id)).state == "MANUAL_REVIEW"
    assert len(sandbox_submits(sandbox, op_id)) == 1


async def test_a_late_success_after_a_failed_resolution_is_flagged_not_hidden(
    engine: AsyncEngine, sandbox: str
) -> None:
    clock = MovableClock()
    op_id = await accept(engine, clock, "pm_ok")
    worker = make_worker(engine, sandbox, clock, lease=timedelta(hours=1))
    async with engine.begin() as conn:
        row = await Ledger(conn).claim_outbox_row(clock(), timedelta(hours=1), "test-worker")
    submission = await worker.dispatcher._pre_submit(row)  # the call stalls...
    assert submission is not None
    clock.advance(timedelta(minutes=3))
    assert await worker.sweeper.sweep() == 1
    for act in (
        lambda ledger, now: escalate(ledger, now, OperatorAction(op_id, "olive", "stuck")),
        lambda ledger, now: resolve(
            ledger, now, OperatorAction(op_id, "olive", "looked like a failure"), Outcome.FAILED
        ),
    ):
        await perform(engine, clock, act)
    # ...and then its success arrives.
    answer = await worker.dispatcher.provider.submit(submission.request)
    await worker.dispatcher.record(row, submission, answer)
    op = await operation(engine, op_id)
    assert (op.state, op.outcome) == ("OUTCOME_KNOWN", "failed")
    assert (op.outcome_contradicted, op.next_action) == (True, "operator")
    assert len(sandbox_charges(sandbox, op_id)) == 1
