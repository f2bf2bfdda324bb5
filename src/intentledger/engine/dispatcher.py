"""The dispatcher: steps 2-5 of docs/decisions/0005, one outbox delivery at a time.

    claim (lease) -> pre-submit transaction (commit SUBMITTING + attempt)
                  -> provider call, outside any transaction
                  -> record transaction (observation + transition + outbox done)

A delivery that finds its operation already SUBMITTING is a resumed delivery:
the previous holder committed SUBMITTING and vanished mid-call, so nobody
knows whether the provider executed it. It becomes UNKNOWN without a call.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.dispatch_plan import (
    SENDABLE_FROM,
    AttemptPlan,
    Authorisation,
    mandate_stop,
    plan_attempt,
)
from intentledger.domain.evidence import Effect, Limits, SubmitAnswer
from intentledger.domain.quick_init import quick_init
from intentledger.domain.retry_after import RetryAfter, parse_retry_after
from intentledger.domain.states import NextAction, State
from intentledger.domain.transport import Classification, ProviderAnswer, Verdict, classify
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.evidence import weigh
from intentledger.engine.unknown import plan_unknown
from intentledger.observability import ledger_events
from intentledger.observability.logs import log_context
from intentledger.providers.base import Provider, ProviderRequest
from intentledger.store.direct import DirectConnections, LedgerConnection
from intentledger.store.ledger import Ledger, Loaded, Made
from intentledger.store.records import (
    AttemptRecord,
    DecisionRecord,
    OperationRecord,
    OutboxRecord,
)

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class DispatchSettings:
    lease: timedelta
    recheck_backoff: timedelta


@quick_init
@dataclass(frozen=True)
class Submission:
    """What the pre-submit transaction committed to send."""

    attempt_number: int
    request: ProviderRequest

    @property
    def key(self) -> str:
        return self.request.idempotency_key


# Fields of our own API that the provider never sees.
OUR_FIELDS = frozenset({"mandate_id", "payment_id"})


def request_for(operation: OperationRecord, idempotency_key: str) -> ProviderRequest:
    """What to send for this operation's kind: its validated body, minus our own fields."""
    context = operation.request_context
    body = {k: v for k, v in context["body"].items() if k not in OUR_FIELDS}
    return ProviderRequest(
        kind=operation.kind,
        reference=operation.operation_id,
        idempotency_key=idempotency_key,
        body=body,
        # The provider's object the write acts on: a card, or the charge a refund reverses.
        target=context.get("provider_card_id") or context.get("charge"),
        under_mandate=bool(context["body"].get("mandate_id")),
        currency=operation.currency,
    )


def submit_result(
    operation: OperationRecord,
    now: datetime,
    source: str,
    attempt_number: int,
    answer: ProviderAnswer,
    classification: Classification,
    retry_after: RetryAfter,
) -> dict[str, Any]:
    """The observation row of an answer to a submit: what the wire showed, as is."""
    return {
        "operation_id": operation.operation_id,
        "actor": operation.actor,
        "at": now,
        "kind": "submit_result",
        "source": source,
        "attempt_number": attempt_number,
        "transport": answer.transport,
        "error_class": answer.error_class,
        "http_status": answer.status,
        "verdict": classification.verdict,
        "reason": classification.reason,
        "provider_reference": answer.provider_reference,
        "retry_after_raw": retry_after.raw,
        "retry_after_at": retry_after.at,
        "retry_after_problem": retry_after.problem,
        "detail": answer.detail or None,
    }


def as_evidence(
    attempt_number: int,
    answer: ProviderAnswer,
    classification: Classification,
    retry_after: RetryAfter,
) -> SubmitAnswer:
    """A classified answer, as the evidence funnel reads it."""
    return SubmitAnswer(
        attempt_number,
        classification.verdict,
        classification.reason,
        answer.provider_reference,
        retry_after,
    )


def begin_attempt(
    operation: OperationRecord,
    plan: AttemptPlan,
    decision_id: int | None,
    now: datetime,
    source: str,
) -> tuple[dict[str, Any], changes.OperationChange]:
    """Step 3's rows, single or batched alike: the attempt, and SUBMITTING
    committed before provider I/O."""
    attempt = {
        "operation_id": operation.operation_id,
        "actor": operation.actor,
        "number": plan.number,
        "provider_idempotency_key": plan.key,
        "submitted_at": now,
        "relation": "original" if plan.resubmission_of is None else "resubmission",
        "resubmission_of": plan.resubmission_of,
        "decision_id": decision_id,
        "source": source,
    }
    change = changes.plan(
        operation,
        State.SUBMITTING,
        now=now,
        next_action=NextAction.WAIT,
        reason=f"attempt {plan.number} committed before provider I/O",
        source=source,
        first_attempt_at=operation.first_attempt_at or now,
    )
    return attempt, change


class Dispatcher:
    def __init__(
        self,
        engine: AsyncEngine,
        provider: Provider,
        clock: Clock,
        settings: DispatchSettings,
        worker_id: str,
        jitter: Callable[[], float] = random.random,
        direct: DirectConnections | None = None,
    ) -> None:
        self.engine = engine
        self.provider = provider
        self.clock = clock
        self.settings = settings
        self.worker_id = worker_id
        self.jitter = jitter
        # The batched first attempts' connections on PostgreSQL (store/direct.py);
        # without them those transactions go through the engine, as every other does.
        self.direct = direct

    async def hot_transaction(self, work: Callable[[LedgerConnection], Awaitable[_T]]) -> _T:
        """`work` in one transaction of the batched first attempts' path: on the
        direct connections where there are some, else on the engine."""
        if self.direct is not None:
            return await self.direct.run(work)
        async with self.engine.begin() as conn:
            return await work(conn)

    async def deliver_submit(self, row: OutboxRecord) -> None:
        with log_context(operation_id=row.operation_id):
            submission = await self._pre_submit(row)
            if submission is None:
                return
            with log_context(attempt=submission.attempt_number):
                answer = await self.provider.submit(submission.request)
                await self.record(row, submission, answer, time.monotonic())

    # -- step 3: pre-submit -------------------------------------------------

    async def _pre_submit(self, row: OutboxRecord) -> Submission | None:
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            planned = changes.Writes(self.clock())
            submission = await self._plan_pre_submit(ledger, row, planned)
            await planned.save(ledger)
            return submission

    async def _plan_pre_submit(
        self, ledger: Ledger, row: OutboxRecord, planned: changes.Writes
    ) -> Submission | None:
        now = planned.now
        # Locks in the one order every writer uses: mandate, operation, outbox row.
        loaded = await ledger.load(row.operation_id, delivery=(row.id, self.worker_id, now))
        assert loaded is not None, "outbox rows reference operations"
        if not loaded.lease_held:
            # The lease ran out before we got here; whoever holds it now delivers.
            return None
        operation = loaded.operation
        state = State(operation.state)
        if state is State.SUBMITTING:
            # Only the row that committed the live attempt may call it resumed;
            # a superseded decision's row has nothing left to deliver.
            planned.finish(row.id)
            live = loaded.last_attempt
            if live is not None and live.decision_id == row.decision_id:
                await self._mark_resumed_unknown(ledger, operation, live.number, planned)
            return None
        if state is State.ACCEPTED and not await self._mandate_allows(ledger, operation, planned):
            planned.finish(row.id)
            return None
        plan = await self._plan_attempt(ledger, operation, loaded.last_attempt, row, planned)
        if plan is None:
            # Nothing (more) to send: settled, cancelled, unresolved without an
            # authorising decision, or a replay whose window has closed.
            planned.finish(row.id)
            return None
        attempt, change = begin_attempt(operation, plan, row.decision_id, now, self.worker_id)
        planned.attempt(**attempt)
        planned.change(change)
        return Submission(plan.number, request_for(operation, plan.key))

    async def _mandate_stop(self, ledger: Ledger, operation: OperationRecord) -> str | None:
        """What of the (already locked) mandate stops this operation being sent now."""
        if operation.mandate_id is None:
            return None
        mandate = await ledger.get_mandate(operation.mandate_id)
        status = mandate.status if mandate is not None else None
        return mandate_stop(operation.kind, operation.mandate_id, status)

    async def _mandate_allows(
        self, ledger: Ledger, operation: OperationRecord, planned: changes.Writes
    ) -> bool:
        """Re-check the mandate before SUBMITTING; a payment whose mandate is no
        longer active is cancelled instead of sent."""
        status = await self._mandate_stop(ledger, operation)
        if status is None:
            return True
        planned.change(
            changes.plan(
                operation,
                State.CANCELLED,
                now=planned.now,
                next_action=NextAction.NONE,
                reason=f"mandate {operation.mandate_id} is {status}: not submitted",
                source=self.worker_id,
                retry_after_at=None,
            )
        )
        return False

    async def _mandate_allows_new_request(
        self, ledger: Ledger, operation: OperationRecord, planned: changes.Writes
    ) -> bool:
        """A new-key request is a new charge: it goes to a person instead when the
        mandate is not active now, whatever was true when the payment was accepted."""
        status = await self._mandate_stop(ledger, operation)
        if status is None:
            return True
        reason = f"new request not sent: mandate {operation.mandate_id} is {status}"
        planned.decide(
            operation_id=operation.operation_id,
            actor=operation.actor,
            at=planned.now,
            rule="mandate_not_active",
            inputs={"mandate_id": operation.mandate_id, "mandate_status": status},
            next_action=NextAction.OPERATOR,
            reason=reason,
            source=self.worker_id,
        )
        if State(operation.state) is State.MANUAL_REVIEW:
            planned.change(
                changes.plan(operation, None, now=planned.now, next_action=NextAction.OPERATOR)
            )
        else:
            planned.change(
                changes.plan(
                    operation,
                    State.MANUAL_REVIEW,
                    now=planned.now,
                    next_action=NextAction.OPERATOR,
                    reason=reason,
                    source=self.worker_id,
                )
            )
        return False

    async def _plan_attempt(
        self,
        ledger: Ledger,
        operation: OperationRecord,
        previous: AttemptRecord | None,
        row: OutboxRecord,
        planned: changes.Writes,
    ) -> AttemptPlan | None:
        """Which attempt this delivery may send (domain/dispatch_plan.py), or None;
        a replay's window and a new request's mandate are checked as it is sent."""
        # A settled or cancelled operation's leftover row sends nothing: no
        # decision to read for it (the hot path of every stale outbox row).
        decision = (
            await ledger.latest_decision(operation.operation_id)
            if previous is not None and State(operation.state) in SENDABLE_FROM
            else None
        )
        plan = plan_attempt(
            operation.operation_id,
            State(operation.state),
            previous.number if previous is not None else None,
            Authorisation(decision.id, decision.next_action, decision.inputs)
            if decision is not None
            else None,
            row.decision_id,
        )
        if plan is None:
            return None
        if plan.replay:
            assert decision is not None, "a replay is authorised by a decision"
            if not await self._replay_still_deduplicated(ledger, operation, decision, planned):
                return None
        if plan.new_request and not await self._mandate_allows_new_request(
            ledger, operation, planned
        ):
            return None
        return plan

    async def _replay_still_deduplicated(
        self,
        ledger: Ledger,
        operation: OperationRecord,
        decision: DecisionRecord,
        planned: changes.Writes,
    ) -> bool:
        """Re-validate a same-key replay at the moment it would be sent: a backlog
        may have pushed the key's age past the rule's bound since the decision."""
        now = planned.now
        key = decision.inputs["provider_idempotency_key"]
        first_use = await ledger.first_use_of_key(operation.operation_id, key)
        bound = timedelta(seconds=decision.inputs["replay_bound_seconds"])
        key_age = now - first_use
        if key_age < bound:
            return True
        reason = (
            f"replay not sent: key age {key_age} reached the bound {bound} between the "
            f"decision at {decision.at.isoformat()} and the send; back to checking"
        )
        planned.decide(
            operation_id=operation.operation_id,
            actor=operation.actor,
            at=now,
            rule="replay_window_closed",
            inputs={
                "superseded_decision_id": decision.id,
                "provider_idempotency_key": key,
                "key_first_used_at": first_use.isoformat(),
                "replay_bound_seconds": bound.total_seconds(),
            },
            next_action=NextAction.RECONCILE,
            reason=reason,
            key_age_at_decision=key_age,
            source=self.worker_id,
        )
        plan_unknown(planned, operation, check_at=now, reason=reason, source=self.worker_id)
        return False

    async def _mark_resumed_unknown(
        self,
        ledger: Ledger,
        operation: OperationRecord,
        attempt_number: int,
        planned: changes.Writes,
    ) -> None:
        reason = (
            "delivery resumed while SUBMITTING: the previous holder's provider call "
            "may or may not have executed; not calling the provider again"
        )
        observation = planned.observe(
            operation_id=operation.operation_id,
            actor=operation.actor,
            at=planned.now,
            kind="resumed_submitting",
            source=self.worker_id,
            attempt_number=attempt_number,
            verdict=Verdict.UNKNOWN,
            reason=reason,
        )
        await self.weigh(
            ledger,
            operation,
            SubmitAnswer(attempt_number, Verdict.UNKNOWN, reason),
            planned,
            observation,
        )

    async def weigh(
        self,
        ledger: Ledger,
        operation: OperationRecord,
        answer: SubmitAnswer,
        planned: changes.Writes,
        observation: Made,
        loaded: Loaded | None = None,
    ) -> Effect:
        """The funnel's judgement of a submit's answer, carried out and saved
        with what the caller planned."""
        return await weigh(
            ledger,
            operation,
            answer,
            now=planned.now,
            limits=Limits(self.settings.recheck_backoff, jitter=self.jitter()),
            source=self.worker_id,
            observation_id=observation,
            writes=planned,
            loaded=loaded,
        )

    # -- step 5: record -----------------------------------------------------

    async def record(
        self,
        row: OutboxRecord,
        submission: Submission,
        answer: ProviderAnswer,
        answered: float | None = None,
    ) -> None:
        """Weigh a provider's answer and commit what it makes of the operation;
        `answered` (`time.monotonic()` at its arrival) times the record delay."""
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            planned = changes.Writes(self.clock())
            now = planned.now
            loaded = await ledger.load(row.operation_id, evidence=True)
            assert loaded is not None
            operation = loaded.operation
            classification = classify(answer)
            retry_after = parse_retry_after(answer.retry_after, now)
            observation = planned.observe(
                **submit_result(
                    operation,
                    now,
                    self.worker_id,
                    submission.attempt_number,
                    answer,
                    classification,
                    retry_after,
                )
            )
            planned.finish(row.id)
            await self.weigh(
                ledger,
                operation,
                as_evidence(submission.attempt_number, answer, classification, retry_after),
                planned,
                observation,
                loaded,
            )
        if answered is not None:
            ledger_events.answers_recorded(operation.kind, "alone", [answered])
