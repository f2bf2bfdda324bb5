"""The pure work of a batched first attempt: the CPU a worker spends on each
payment's records, decisions and rows with no I/O at all (issue 39).

python -m intentledger_tools.bench.domain_cost [--payments N] [--claim C] [--group G]

The libraries' floor (bench/library_floor.py) is what aiohttp, psycopg and
SQLAlchemy cost doing a payment's I/O with none of our code. This is the other
part a worker cannot skip while the domain decides and is pure: the calls the
batched path (engine/batch_dispatch.py, engine/settlement_queue.py) makes per
payment between its reads and its writes, in pre-submits of C payments and
group records of G, on rows shaped as the store returns them:

- pre-submit: the operation's record from its row, whether it is a plain
  first attempt, the attempt and its change, the request to send, the
  change's news, and the group's rows in one set of columns (`alike`);
- record: the record of the operation as the pre-submit handed it on, the answer's
  classification, Retry-After and evidence, the funnel's judgement and
  settlement, the observation row, the news, and `alike` again.

Left out: what a transaction does after its writes besides the news
(`changes.follow`'s metrics at commit, `ledger_events.flags_raised` and the
card projection, which a payment does not have) and the record delay's
histogram: metrics, not decisions, and each a few calls a group.

Every payment must settle plainly, or the run fails: a change of the domain
that made this stop measuring the path would otherwise go unseen. The result
is one line, `domain_cost {json}`: payments, the two sizes, the process's CPU
seconds for the work (`time.process_time()`) and the microseconds a payment.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from intentledger.domain.dispatch_plan import (
    FIRST_ATTEMPT,
    AttemptPlan,
    batchable_first_attempt,
    mandate_stop,
    provider_key,
)
from intentledger.domain.evidence import Limits
from intentledger.domain.merchant_events import operation_events
from intentledger.domain.retry_after import parse_retry_after
from intentledger.domain.states import State
from intentledger.domain.transport import ProviderAnswer, Transport, classify
from intentledger.engine import changes
from intentledger.engine.announcements import view_of
from intentledger.engine.dispatcher import (
    Submission,
    as_evidence,
    begin_attempt,
    request_for,
    submit_result,
)
from intentledger.engine.settlement_queue import Prepared, Sent, _plain_settlement
from intentledger.providers.sandbox_client import map_answer
from intentledger.store.records import OperationRecord

RESULT_PREFIX = "domain_cost "
WORKER = "domain-cost"
NOW = datetime(2026, 12, 5, tzinfo=UTC)
BODY = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}


def operation_row(number: int, **changed: Any) -> tuple[Any, ...]:
    """An ACCEPTED payment's row as `select(operations)` returns it, in column
    order; `changed`: columns that differ (a missing or unknown column fails)."""
    values: dict[str, Any] = {
        "operation_id": f"op_{number:024x}",
        "idempotency_key": f"key-{number}",
        "state": "ACCEPTED",
        "request_context": {"body": BODY},
        "first_attempt_at": None,
        "last_observed_at": None,
        "retry_after_at": None,
        "reconciliation_status": None,
        "key_age_at_decision": None,
        "provider_retention_note": None,
        "next_action": "SUBMIT",
        "actor": "bench",
        "route": "POST /v1/payments",
        "kind": "payment",
        "request_hash": "h" * 64,
        "provider": "sandbox",
        "provider_reference": None,
        "outcome": None,
        "amount": 1250,
        "currency": "EUR",
        "mandate_id": None,
        "version": 1,
        "created_at": NOW,
        "updated_at": NOW,
        "duplicate_detected": False,
        "outcome_contradicted": False,
        "executed_references": [],
        "parent_operation_id": None,
        "reaped_at": None,
        "reaped_through_observation": None,
        "watch": None,
        "live_keys": 0,
    }
    unknown = set(changed) - set(values)
    if unknown:
        raise KeyError(f"operations has no column {sorted(unknown)}")
    values.update(changed)
    return tuple(values[name] for name in OperationRecord.__match_args__)


def news(change: changes.OperationChange) -> list[str]:
    """The merchant events a change is news of (engine/announcements.py)."""
    return operation_events(view_of(change.before), view_of(change.before, change.values))


def pre_submit(rows: Sequence[tuple[Any, ...]]) -> list[Prepared]:
    """A claim's pure work before its provider calls (batch_dispatch.pre_submit)."""
    prepared: list[Prepared] = []
    beginning: list[changes.OperationChange] = []
    for row in rows:
        operation = OperationRecord.of(row)  # type: ignore[arg-type]
        stop = mandate_stop(operation.kind, operation.mandate_id, None)
        if not batchable_first_attempt(
            operation.kind,
            State(operation.state),
            attempted=operation.first_attempt_at is not None,
            delivered_decision_id=None,
            stop=stop,
        ):
            raise RuntimeError(f"{operation.operation_id} is not a plain first attempt")
        plan = AttemptPlan(FIRST_ATTEMPT, provider_key(operation.operation_id), None)
        _, change = begin_attempt(operation, plan, None, NOW, WORKER)
        submission = Submission(FIRST_ATTEMPT, request_for(operation, plan.key))
        prepared.append(Prepared(None, submission, operation.updated(change.values)))  # type: ignore[arg-type]
        beginning.append(change)
    changes.alike(beginning)
    for change in beginning:
        news(change)
    return prepared


def record(prepared: Sequence[Prepared], limits: Limits) -> int:
    """A group record's pure work (settlement_queue.record_together); how many
    it settled plainly."""
    settled: list[changes.OperationChange] = []
    for item in prepared:
        # Planned from the record the pre-submit handed on: on PostgreSQL a
        # group record reads no row (engine/settlement_queue.py).
        operation = item.operation
        # As providers/http.py (`answer_of`) makes it of a response: read, then
        # made again with the adapter's mapping.
        seen: dict[str, Any] = {
            "status": 200,
            "provider_reference": "ch_1",
            "detail": {"body": {"id": "ch_1", "status": "succeeded"}},
        }
        answer = ProviderAnswer(Transport.RESPONSE, **seen)
        answer = ProviderAnswer(Transport.RESPONSE, **seen, mapped=map_answer(answer))
        classification = classify(answer)
        retry_after = parse_retry_after(answer.retry_after, NOW)
        evidence = as_evidence(FIRST_ATTEMPT, answer, classification, retry_after)
        change = _plain_settlement(
            operation, Sent(item, answer, 0.0), evidence, NOW, limits, WORKER
        )
        if change is None:
            continue
        submit_result(operation, NOW, WORKER, FIRST_ATTEMPT, answer, classification, retry_after)
        settled.append(change)
    changes.alike(settled)
    for change in settled:
        news(change)
    return len(settled)


def measure(payments: int, claim: int, group: int) -> dict[str, Any]:
    """The pure work of `payments` first attempts, pre-submitted `claim` at a
    time and recorded `group` at a time, timed."""
    accepted = [operation_row(n) for n in range(payments)]
    limits = Limits(timedelta(hours=1))
    settled = 0
    started = time.process_time()
    prepared: list[Prepared] = []
    for start in range(0, payments, claim):
        prepared.extend(pre_submit(accepted[start : start + claim]))
    for start in range(0, payments, group):
        end = start + group
        settled += record(prepared[start:end], limits)
    cpu_s = time.process_time() - started
    if settled != payments:
        raise RuntimeError(f"only {settled} of {payments} payments settled plainly")
    return {
        "payments": payments,
        "claim": claim,
        "group": group,
        "cpu_s": round(cpu_s, 4),
        "us_per_payment": round(cpu_s * 1e6 / payments, 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--payments", type=int, default=20_000)
    parser.add_argument("--claim", type=int, default=24, help="payments a pre-submit holds")
    parser.add_argument("--group", type=int, default=20, help="answers a group record holds")
    args = parser.parse_args(argv)
    if min(args.payments, args.claim, args.group) < 1:
        parser.error("--payments, --claim and --group must be at least 1")
    # Once unmeasured first, so imports and first calls' caches are not counted.
    measure(min(args.payments, 1_000), args.claim, args.group)
    result = measure(args.payments, args.claim, args.group)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
