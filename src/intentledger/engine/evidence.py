"""Carrying out the funnel's judgement: the one way evidence changes the ledger.

Each caller (the dispatcher, single and batched, the reconciler's checks and
audits, the sweeper, operator resolutions) records its observation, reads the
operation's `Facts` here, asks `domain.evidence.judge` what the evidence means,
and hands the `Effect` to `carry_out` — in the same transaction, under the
operation's lock. None of them decides an outcome itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from intentledger.domain.evidence import (
    AttemptFacts,
    Effect,
    Evidence,
    Facts,
    Limits,
    Move,
    judge,
    recorded_executions,
)
from intentledger.domain.states import FINAL, NextAction, Outcome, State
from intentledger.domain.transport import PROVING, Verdict
from intentledger.domain.watching import Watch, settled_next_action
from intentledger.engine import changes
from intentledger.engine.refund_settlement import after_refund_settled
from intentledger.engine.unknown import plan_unknown
from intentledger.store.ledger import EvidenceRow, Ledger, Loaded, Made, Rows
from intentledger.store.records import OperationRecord

# Sends an operation without evidence to the safety review (the reconciler's).
Review = Callable[[Ledger, OperationRecord, datetime, str, str], Awaitable[None]]


async def facts_of(
    ledger: Ledger,
    operation: OperationRecord,
    planned: Rows | None = None,
    loaded: Loaded | None = None,
) -> Facts:
    """What the ledger knows about `operation`, read from its append-only rows
    (`loaded` with them, or read now) and the observations and decisions this
    unit of work `planned` (the newest, written with the effect: what the
    ledger will know once it commits)."""
    observations = planned.observations if planned is not None else ()
    decisions = planned.decisions if planned is not None else ()
    answers: dict[int | None, tuple[Verdict, str | None]] = {}
    checks = audits = 0
    rows: list[Any] = list(
        loaded.evidence
        if loaded is not None and loaded.evidence is not None
        else await ledger.evidence_rows(operation.operation_id)
    )
    rows += [
        EvidenceRow(
            values["kind"],
            values.get("attempt_number"),
            values.get("verdict"),
            values.get("provider_reference"),
        )
        for values in observations
        if values["operation_id"] == operation.operation_id
    ]
    pending: set[int | None] = set()
    for row in rows:
        if row.kind == "submit_result" and row.verdict == Verdict.PENDING:
            pending.add(row.attempt_number)
        if row.kind == "submit_result" and row.verdict in PROVING:
            answers.setdefault(row.attempt_number, (Verdict(row.verdict), row.provider_reference))
        elif row.kind == "lookup_result":
            checks += 1
        elif row.kind == "audit_lookup":
            audits += 1
    attempts = []
    for a in (
        loaded.attempts if loaded is not None else await ledger.attempts_of(operation.operation_id)
    ):
        answer, reference = answers.get(a.number, (None, None))
        key = a.provider_idempotency_key
        attempts.append(AttemptFacts(a.number, key, answer, reference, sent_at=a.submitted_at))
    return Facts(
        state=State(operation.state),
        outcome=Outcome(operation.outcome) if operation.outcome else None,
        provider_reference=operation.provider_reference,
        attempts=tuple(attempts),
        executed=recorded_executions(
            operation.executed_references, operation.outcome, operation.provider_reference
        ),
        checks=checks,
        audits=audits,
        unresolved_since=operation.first_attempt_at,
        duplicate_detected=operation.duplicate_detected,
        outcome_contradicted=operation.outcome_contradicted,
        watch=Watch(operation.watch) if operation.watch else None,
        # Only a settled operation's watching asks (an unresolved one is SUBMITTING).
        submit_in_flight=State(operation.state) in FINAL
        and await ledger.submit_pending(operation.operation_id),
        authorised_keys=await authorised_keys(ledger, operation, decisions),
        last_attempt_pending=bool(attempts) and attempts[-1].number in pending,
    )


async def authorised_keys(
    ledger: Ledger, operation: OperationRecord, planned: Sequence[Mapping[str, Any]] = ()
) -> frozenset[str]:
    """The key a decision authorised to be sent next (a new request, or a
    same-key replay), while the operation waits to send it. The latest decision
    is the newest this unit of work `planned` for it, if any (a person's
    resolution supersedes an approval not yet sent), else the ledger's."""
    if operation.next_action != NextAction.RESUBMIT:
        return frozenset()
    mine = [d for d in planned if d["operation_id"] == operation.operation_id]
    if mine:
        next_action, inputs = mine[-1]["next_action"], mine[-1]["inputs"]
    else:
        decision = await ledger.latest_decision(operation.operation_id)
        if decision is None:
            return frozenset()
        next_action, inputs = decision.next_action, decision.inputs
    if next_action != NextAction.RESUBMIT:
        return frozenset()
    return frozenset({inputs["provider_idempotency_key"]})


async def weigh(
    ledger: Ledger,
    operation: OperationRecord,
    evidence: Evidence,
    *,
    now: datetime,
    limits: Limits,
    source: str,
    review: Review | None = None,
    observation_id: Made | int | None = None,
    writes: changes.Writes | None = None,
    loaded: Loaded | None = None,
) -> Effect:
    """Judge `evidence` against what the ledger knows, and carry the effect out.
    `writes`: what the caller planned in this unit of work (its observation of
    the evidence, the outbox row done), saved with the effect in one store call;
    `loaded`: the operation's rows as the caller loaded them with its lock."""
    facts = await facts_of(ledger, operation, writes.rows if writes else None, loaded)
    effect = judge(facts, evidence, now, limits)
    await carry_out(
        ledger,
        operation,
        facts,
        effect,
        now=now,
        source=source,
        review=review,
        observation_id=observation_id,
        writes=writes,
    )
    return effect


def _flags(operation: OperationRecord, facts: Facts, effect: Effect) -> dict[str, Any]:
    """The record's fields the effect changes besides its state."""
    fields: dict[str, Any] = {}
    if effect.executed != facts.executed:
        fields["executed_references"] = sorted(effect.executed)
    if effect.adopt_reference is not None and operation.provider_reference is None:
        fields["provider_reference"] = effect.adopt_reference
    if effect.duplicate:
        fields["duplicate_detected"] = True
    if effect.contradiction:
        fields["outcome_contradicted"] = True
        fields["next_action"] = NextAction.OPERATOR
    if effect.reconciliation_status is not None:
        fields["reconciliation_status"] = effect.reconciliation_status
    if effect.live_keys != operation.live_keys:
        fields["live_keys"] = effect.live_keys
    if effect.watch is not None:
        fields["watch"] = effect.watch
    if effect.next_action is not None:
        fields["next_action"] = effect.next_action
    return fields


def settlement(
    operation: OperationRecord, facts: Facts, effect: Effect, *, now: datetime, source: str
) -> changes.OperationChange:
    """The change an outcome makes (Move.SETTLE), single or batched alike."""
    assert effect.move is Move.SETTLE and effect.outcome is not None
    fields = _flags(operation, facts, effect)
    return changes.plan(
        operation,
        State.OUTCOME_KNOWN,
        now=now,
        next_action=fields.pop("next_action", NextAction.NONE),
        reason=effect.reason,
        source=source,
        outcome=effect.outcome,
        last_observed_at=now,
        retry_after_at=None,
        **fields,
    )


async def carry_out(
    ledger: Ledger,
    operation: OperationRecord,
    facts: Facts,
    effect: Effect,
    *,
    now: datetime,
    source: str,
    review: Review | None = None,
    observation_id: Made | int | None = None,
    writes: changes.Writes | None = None,
) -> None:
    """Plan the effect's rows beside the caller's, and save them once. Two
    effects reach past the operation and save first: a settled refund's remedy
    on its payment, and the safety review (each loads what it weighs)."""
    planned = writes if writes is not None else changes.Writes(now)
    fields = _flags(operation, facts, effect)
    move = effect.move
    if move is Move.SETTLE:
        planned.change(settlement(operation, facts, effect, now=now, source=source))
        if operation.kind == "refund":
            await planned.save(ledger)
            settled = await _relock(ledger, operation)
            await after_refund_settled(ledger, settled, now, source)
    elif move is Move.UNKNOWN:
        assert effect.check_at is not None
        plan_unknown(
            planned,
            operation,
            check_at=effect.check_at,
            reason=effect.reason,
            source=source,
            **fields,
        )
    elif move is Move.REQUEUE:
        _requeue(planned, operation, facts, effect, source, observation_id, fields)
    elif move is Move.REVIEW:
        assert review is not None, "only a scheduled check sends an operation to review"
        fields.pop("reconciliation_status", None)  # the review writes it with its transition
        if fields:
            planned.change(changes.plan(operation, None, now=now, **fields))
            await planned.save(ledger)
            operation = await _relock(ledger, operation)
        else:
            await planned.save(ledger)
        await review(ledger, operation, now, effect.reason, str(effect.reconciliation_status))
    elif move is Move.OPERATOR:
        _to_a_person(planned, operation, facts, effect, source, fields, observation_id)
    elif move is Move.RESOLVE_CONTRADICTION:
        # The executions the provider showed stay written down whatever outcome
        # is stated.
        fields["executed_references"] = sorted(effect.executed)
        fields.pop("next_action", None)
        planned.change(
            changes.plan(
                operation,
                None,
                now=now,
                outcome=effect.outcome,
                outcome_contradicted=False,
                # A duplicate still flagged, or a provider still not quiet, still needs a person.
                next_action=settled_next_action(facts.duplicate_detected, False, facts.watch),
                last_observed_at=now,
                **fields,
            )
        )
    elif move is Move.RECHECK:
        assert effect.check_at is not None
        planned.change(
            changes.plan(
                operation,
                None,
                now=now,
                last_observed_at=now,
                retry_after_at=effect.check_at,
                **fields,
            )
        )
        planned.enqueue(operation, "reconcile", effect.check_at)
    elif fields:
        planned.change(changes.plan(operation, None, now=now, **fields))
    if effect.not_final is not None:
        _provider_not_final(planned, operation, effect, now, source)
    if effect.verify_at is not None:
        planned.enqueue(operation, "audit", effect.verify_at)
    await planned.save(ledger)


def _provider_not_final(
    planned: changes.Writes, operation: OperationRecord, effect: Effect, now: datetime, source: str
) -> None:
    """The looks' budget ran out while the provider still shows something open: a
    person is told what, and why watching goes on (the decision row)."""
    assert effect.verify_at is not None
    planned.decide(
        operation_id=operation.operation_id,
        actor=operation.actor,
        at=now,
        rule="provider_not_final",
        inputs={"open": effect.not_final, "next_look_at": effect.verify_at.isoformat()},
        next_action=NextAction.OPERATOR,
        reason=(
            f"the provider is not quiet ({effect.not_final}): the amount stays held and "
            "the looks go on until it is"
        ),
        source=source,
    )


async def _relock(ledger: Ledger, operation: OperationRecord) -> OperationRecord:
    fresh = await ledger.lock_operation(operation.operation_id)
    assert fresh is not None
    return fresh


def _requeue(
    planned: changes.Writes,
    operation: OperationRecord,
    facts: Facts,
    effect: Effect,
    source: str,
    observation_id: Made | int | None,
    fields: dict[str, Any],
) -> None:
    """Evidence that the provider did not execute: back to ACCEPTED, sent again
    with the same provider key no earlier than the funnel's time, under a
    recorded decision citing that evidence."""
    assert effect.check_at is not None
    assert facts.attempts, "only an attempt can be refused"
    fields.pop("next_action", None)  # the requeue says what is next
    attempt = facts.attempts[-1]
    due, now = effect.check_at, planned.now
    decision = planned.decide(
        operation_id=operation.operation_id,
        actor=operation.actor,
        at=now,
        rule="non_execution_evidence",
        inputs={
            "observation_id": observation_id,
            "evidence": effect.reason,
            "attempt_number": attempt.number,
            "provider_idempotency_key": attempt.key,
            "send_no_earlier_than": due.isoformat(),
            "timing": effect.timing,
        },
        next_action=NextAction.SUBMIT,
        reason=(
            f"attempt {attempt.number} proved not executed ({effect.reason}); submit again "
            f"with the same provider key no earlier than {due.isoformat()}: {effect.timing}"
        ),
        source=source,
    )
    planned.change(
        changes.plan(
            operation,
            State.ACCEPTED,
            now=now,
            next_action=NextAction.SUBMIT,
            reason=effect.reason,
            source=source,
            last_observed_at=now,
            retry_after_at=due,
            **fields,
        )
    )
    planned.enqueue(operation, "submit", due, decision=decision)


def _to_a_person(
    planned: changes.Writes,
    operation: OperationRecord,
    facts: Facts,
    effect: Effect,
    source: str,
    fields: dict[str, Any],
    observation_id: Made | int | None,
) -> None:
    """A person decides (a decision row says why under which rule): past the
    limits with no outcome, the checks go on, so evidence still settles it when
    it comes; after a refusal only a person can fix (a configuration error),
    nothing was executed and there is nothing to check."""
    now = planned.now
    if effect.rule == "checks_exhausted":
        assert effect.check_at is not None
        inputs: dict[str, Any] = {
            "checks": facts.checks + 1,
            "unresolved_since": facts.unresolved_since.isoformat()
            if facts.unresolved_since
            else None,
            "reconciliation_status": effect.reconciliation_status,
            "next_check_at": effect.check_at.isoformat(),
        }
    else:
        inputs = {"observation_id": observation_id, "evidence": effect.reason}
    planned.decide(
        operation_id=operation.operation_id,
        actor=operation.actor,
        at=now,
        rule=effect.rule,
        inputs=inputs,
        next_action=NextAction.OPERATOR,
        reason=effect.reason,
        source=source,
    )
    fields.pop("next_action", None)  # a person is what is next
    planned.change(
        changes.plan(
            operation,
            State.MANUAL_REVIEW,
            now=now,
            next_action=NextAction.OPERATOR,
            reason=effect.reason,
            source=source,
            last_observed_at=now,
            retry_after_at=effect.check_at,
            **fields,
        )
    )
    if effect.check_at is not None:
        planned.enqueue(operation, "reconcile", effect.check_at)
