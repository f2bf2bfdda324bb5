"""Outcome reconciliation: evidence from the provider, never from the clock.

    UNKNOWN --retry_after_at reached--> RECONCILIATION_DUE   (a transition, recorded)
            --lookup by our reference, outside any transaction-->
    found succeeded / failed  -> OUTCOME_KNOWN, with the evidence
    still processing          -> UNKNOWN, the next look scheduled
    not found, lookup failed  -> SAFETY_REVIEW (which may order a resubmission)

`reconciliation_status` records what each check produced; it never means
"safe to resubmit". A lookup that arrives for an operation waiting anywhere
unresolved is still recorded, and a definite one settles it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.backoff import next_check_at, recheck_delay
from intentledger.domain.retry_after import RetryAfter, parse_retry_after
from intentledger.domain.states import UNRESOLVED, NextAction, Outcome, State
from intentledger.domain.transport import (
    LookupAnswer,
    LookupJudgement,
    LookupVerdict,
    judge_lookup,
)
from intentledger.engine.audit import AUDIT_ATTEMPTS, settle
from intentledger.engine.clock import Clock
from intentledger.engine.safety_review import PolicyFor, RulesFor, run_safety_review
from intentledger.engine.unknown import mark_unknown
from intentledger.providers.base import Provider, ProviderLookup, ProviderRequest
from intentledger.store.ledger import Ledger
from intentledger.store.tables import Record

_SETTLING = {LookupVerdict.SUCCEEDED: Outcome.SUCCEEDED, LookupVerdict.FAILED: Outcome.FAILED}


def operation_lookup(operation: Record) -> ProviderLookup:
    """The provider read that would show this operation's write."""
    return ProviderLookup(
        kind=operation.kind,
        reference=operation.operation_id,
        target=operation.request_context.get("provider_card_id"),
    )


class Reconciler:
    def __init__(
        self,
        engine: AsyncEngine,
        provider: Provider,
        clock: Clock,
        recheck_backoff: timedelta,
        policy_for: PolicyFor,
        rules_for: RulesFor,
        worker_id: str,
        jitter: Callable[[], float] = random.random,
        blind_retry_for_tests: bool = False,
    ) -> None:
        self.blind_retry_for_tests = blind_retry_for_tests
        self.engine = engine
        self.provider = provider
        self.clock = clock
        self.recheck_backoff = recheck_backoff
        self.policy_for = policy_for
        self.rules_for = rules_for
        self.worker_id = worker_id
        self.jitter = jitter

    async def deliver_reconcile(self, row: Record) -> None:
        operation = await self._begin_check(row)
        if operation is None:
            return
        if self.blind_retry_for_tests:
            await self._blind_retry(operation)
        lookup = await self.provider.lookup(operation_lookup(operation))
        await self._record_check(row, lookup)

    async def deliver_audit(self, row: Record) -> None:
        """Count executed charges under a settled operation's reference."""
        async with self.engine.begin() as conn:
            if not await Ledger(conn).holds_lease(row.id, self.worker_id, self.clock()):
                return
        async with self.engine.connect() as conn:
            settled = await Ledger(conn).get_operation(row.operation_id)
        assert settled is not None
        lookup = await self.provider.lookup(operation_lookup(settled))
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            now = self.clock()
            operation = await ledger.lock_operation(row.operation_id)
            assert operation is not None
            judgement = judge_lookup(lookup)
            await ledger.add_observation(
                operation_id=operation.operation_id,
                at=now,
                kind="audit_lookup",
                source=self.worker_id,
                transport=lookup.answer.transport,
                error_class=lookup.answer.error_class,
                http_status=lookup.answer.status,
                verdict=judgement.verdict,
                reason=judgement.reason,
                detail={"charges": [c.provider_reference for c in lookup.charges]},
            )
            seen = {charge.provider_reference for charge in lookup.charges}
            # A lookup that does not even show the charge we know of is lagging,
            # not evidence that there is no second one: look again.
            lagging = operation.provider_reference is not None and (
                operation.provider_reference not in seen
            )
            if judgement.executed_charges > 1 and not operation.duplicate_detected:
                await ledger.update_operation(operation, now=now, duplicate_detected=True)
            elif judgement.executed_charges and operation.outcome != Outcome.SUCCEEDED:
                # Settled failed, yet the provider shows an executed charge.
                await ledger.update_operation(
                    operation, now=now, outcome_contradicted=True, next_action=NextAction.OPERATOR
                )
            elif judgement.verdict is LookupVerdict.LOOKUP_FAILED or lagging:
                audits = len(await ledger.observations_of_kind(row.operation_id, "audit_lookup"))
                if audits < AUDIT_ATTEMPTS:
                    delay = recheck_delay(audits, self.recheck_backoff, jitter=self.jitter())
                    await ledger.enqueue(row.operation_id, "audit", now + delay, now)
            await ledger.finish_outbox_row(row.id, now)

    async def _blind_retry(self, operation: Record) -> None:
        """THE BUG the chaos harness must catch (settings.break_for_tests): a timer
        resends an UNKNOWN operation with a new key and records nothing."""
        body = {k: v for k, v in operation.request_context["body"].items() if k != "mandate_id"}
        await self.provider.submit(
            ProviderRequest(
                operation.kind, operation.operation_id, f"{operation.operation_id}:blind", body
            )
        )

    async def _begin_check(self, row: Record) -> Record | None:
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            now = self.clock()
            # Locks in the one order every writer uses: mandate, operation, outbox row.
            operation = await ledger.lock_operation(row.operation_id)
            assert operation is not None
            if not await ledger.holds_lease(row.id, self.worker_id, now):
                return None
            state = State(operation.state)
            if state is State.UNKNOWN:
                await ledger.transition(
                    operation,
                    State.RECONCILIATION_DUE,
                    now=now,
                    next_action=NextAction.RECONCILE,
                    reason=f"check due at {_iso(operation.retry_after_at)}: asking the provider",
                    source=self.worker_id,
                )
            elif state is not State.RECONCILIATION_DUE:
                # Settled or moved on since this check was scheduled. (A resumed
                # RECONCILIATION_DUE simply looks again: lookups are reads.)
                await ledger.finish_outbox_row(row.id, now)
                return None
            return operation

    async def _record_check(self, row: Record, lookup: LookupAnswer) -> None:
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            now = self.clock()
            operation = await ledger.lock_operation(row.operation_id)
            assert operation is not None
            judgement = judge_lookup(lookup)
            answer = lookup.answer
            retry_after = parse_retry_after(answer.retry_after, now)
            await ledger.add_observation(
                operation_id=operation.operation_id,
                at=now,
                kind="lookup_result",
                source=self.worker_id,
                transport=answer.transport,
                error_class=answer.error_class,
                http_status=answer.status,
                verdict=judgement.verdict,
                reason=judgement.reason,
                provider_reference=judgement.provider_reference,
                retry_after_raw=retry_after.raw,
                retry_after_at=retry_after.at,
                retry_after_problem=retry_after.problem,
                detail={"charges": [c.provider_reference for c in lookup.charges]},
            )
            state = State(operation.state)
            judgement = await _conclusive(ledger, operation, judgement)
            outcome = _SETTLING.get(judgement.verdict)
            if outcome is not None and (state in UNRESOLVED):
                await settle(
                    ledger,
                    operation,
                    outcome,
                    now=now,
                    reason=f"lookup evidence: {judgement.reason}",
                    source=self.worker_id,
                    audit_after=self.recheck_backoff,
                    provider_reference=judgement.provider_reference,
                    reconciliation_status=judgement.verdict,
                    duplicate_detected=judgement.executed_charges > 1,
                )
            elif state is State.RECONCILIATION_DUE:
                await self._unresolved(
                    ledger, operation, now, judgement.verdict, judgement.reason, retry_after
                )
            await ledger.finish_outbox_row(row.id, now)

    async def _unresolved(
        self,
        ledger: Ledger,
        operation: Record,
        now: datetime,
        verdict: LookupVerdict,
        reason: str,
        retry_after: RetryAfter,
    ) -> None:
        if verdict is LookupVerdict.PROCESSING:
            checks = len(await ledger.lookups_of(operation.operation_id))
            delay = recheck_delay(checks, self.recheck_backoff, jitter=self.jitter())
            await mark_unknown(
                ledger,
                operation,
                now=now,
                check_at=next_check_at(now, retry_after, delay),
                reason=f"still processing: {reason}",
                source=self.worker_id,
                reconciliation_status=verdict,
            )
            return
        await run_safety_review(
            ledger,
            operation,
            now=now,
            policy=self.policy_for(operation.provider),
            rules=self.rules_for(operation.provider),
            source=self.worker_id,
            reason=f"no evidence: {reason}",
            reconciliation_status=verdict,
        )


async def _conclusive(
    ledger: Ledger, operation: Record, judgement: LookupJudgement
) -> LookupJudgement:
    """Only failed charges under our reference prove failure only if one provider
    key was ever used: a charge under another key may not be listed yet."""
    if judgement.verdict is not LookupVerdict.FAILED:
        return judgement
    keys = await ledger.distinct_keys(operation.operation_id)
    if len(keys) <= 1:
        return judgement
    return LookupJudgement(
        LookupVerdict.NOT_FOUND,
        f"{judgement.reason}, but {len(keys)} provider keys were used: not conclusive",
    )


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else "now"
