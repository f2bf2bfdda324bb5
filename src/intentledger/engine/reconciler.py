"""Outcome reconciliation: evidence from the provider, never from the clock.

    UNKNOWN --retry_after_at reached--> RECONCILIATION_DUE   (a transition, recorded)
            --lookup by our reference, outside any transaction-->
            --the evidence funnel (domain/evidence.py) judges what it showed-->
    found succeeded / failed  -> OUTCOME_KNOWN, with the evidence
    still processing          -> UNKNOWN, the next look scheduled; past the
                                 checks/age limits, MANUAL_REVIEW and still looking
    not found, lookup failed  -> SAFETY_REVIEW (which may order a resubmission)

`reconciliation_status` records what each check produced; it never means
"safe to resubmit". A lookup that arrives for an operation waiting anywhere
unresolved is still recorded, and a definite one settles it. The audit is the
same lookup of a settled operation, judged by the same funnel.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.backoff import recheck_delay
from intentledger.domain.evidence import Limits, LookupResult
from intentledger.domain.retry_after import parse_retry_after
from intentledger.domain.states import NextAction, State
from intentledger.domain.transport import LookupAnswer, ProviderAnswer, Transport, judge_lookup
from intentledger.engine import changes
from intentledger.engine.clock import Clock
from intentledger.engine.evidence import weigh
from intentledger.engine.safety_review import PolicyFor, RulesFor, run_safety_review
from intentledger.providers.base import Provider, ProviderLookup
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord, OutboxRecord


async def operation_lookup(
    ledger: Ledger, operation: OperationRecord, *, exhaustive: bool = False
) -> ProviderLookup:
    """The provider read that would show this operation's write: by our
    reference, and by every provider id an answer or a lookup already named."""
    named = {
        row.provider_reference
        for row in await ledger.evidence_rows(operation.operation_id)
        if row.provider_reference
    }
    named |= set(operation.executed_references or ())
    if operation.provider_reference:
        named.add(operation.provider_reference)
    # With more than one key sent, a payment under a key whose answer named
    # nothing may exist beside the ones named: look for every one.
    keys = {a.provider_idempotency_key for a in await ledger.attempts_of(operation.operation_id)}
    return ProviderLookup(
        kind=operation.kind,
        reference=operation.operation_id,
        target=operation.request_context.get("provider_card_id")
        or operation.request_context.get("charge"),
        known=tuple(sorted(named)),
        exhaustive=exhaustive or len(keys) > 1,
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
        *,
        has_lookup: bool = True,
    ) -> None:
        self.engine = engine
        self.provider = provider
        self.clock = clock
        self.recheck_backoff = recheck_backoff
        self.policy_for = policy_for
        self.rules_for = rules_for
        self.worker_id = worker_id
        self.jitter = jitter
        # False: the provider cannot be asked (LookupConsistency.available).
        self.has_lookup = has_lookup

    async def _look(self, query: ProviderLookup) -> LookupAnswer:
        """Ask the provider; one without a lookup is not asked, and the answer
        says so (`no_lookup`): the funnel sends an unresolved operation to the
        safety review, whose same-key resend within the key's retention is this
        provider's read, and a settled one waits for its notifications."""
        if self.has_lookup:
            return await self.provider.lookup(query)
        nothing = ProviderAnswer(Transport.NOT_SENT, error_class="no lookup")
        method = f"none: {self.provider.name} has no lookup"
        return LookupAnswer(nothing, asked=False, method=method)

    async def deliver_reconcile(self, row: OutboxRecord) -> None:
        begun = await self._begin_check(row)
        if begun is None:
            return
        _, query = begun
        looked_at = self.clock()
        lookup = await self._look(query)
        await self._record_lookup(row, lookup, kind="lookup_result", looked_at=looked_at)

    async def deliver_audit(self, row: OutboxRecord) -> None:
        """Look at a settled operation again: every charge the provider shows
        under our reference meets the recorded outcome in the funnel (a second
        execution, a contradiction, a charge a person's statement did not name)."""
        async with self.engine.begin() as conn:
            if not await Ledger(conn).holds_lease(row.id, self.worker_id, self.clock()):
                return
        async with self.engine.connect() as conn:
            ledger = Ledger(conn)
            settled = await ledger.get_operation(row.operation_id)
            assert settled is not None
            # The audit looks for every execution, not just the one it knows.
            query = await operation_lookup(ledger, settled, exhaustive=True)
        # The look is as late as its start: what landed after may not be in it.
        looked_at = self.clock()
        lookup = await self._look(query)
        await self._record_lookup(row, lookup, kind="audit_lookup", looked_at=looked_at)

    async def _begin_check(
        self, row: OutboxRecord
    ) -> tuple[OperationRecord, ProviderLookup] | None:
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            planned = changes.Writes(self.clock())
            # Locks in the one order every writer uses: mandate, operation, outbox row.
            operation = await ledger.lock_operation(row.operation_id)
            assert operation is not None
            if not await ledger.holds_lease(row.id, self.worker_id, planned.now):
                return None
            state = State(operation.state)
            if state is State.UNKNOWN:
                planned.change(
                    changes.plan(
                        operation,
                        State.RECONCILIATION_DUE,
                        now=planned.now,
                        next_action=NextAction.RECONCILE,
                        reason=(
                            f"check due at {_iso(operation.retry_after_at)}: asking the provider"
                        ),
                        source=self.worker_id,
                    )
                )
            elif state not in (State.RECONCILIATION_DUE, State.MANUAL_REVIEW):
                # Settled or moved on since this check was scheduled. (A resumed
                # RECONCILIATION_DUE simply looks again: lookups are reads. A
                # person's queue is looked at while it stays there: the funnel
                # keeps checking what the provider still calls processing.)
                planned.finish(row.id)
                await planned.save(ledger)
                return None
            query = await operation_lookup(ledger, operation)
            await planned.save(ledger)
            return operation, query

    async def _record_check(self, row: OutboxRecord, lookup: LookupAnswer) -> None:
        await self._record_lookup(row, lookup, kind="lookup_result")

    async def _record_lookup(
        self, row: OutboxRecord, lookup: LookupAnswer, kind: str, looked_at: datetime | None = None
    ) -> None:
        """Record what the lookup showed, and let the funnel judge it."""
        async with self.engine.begin() as conn:
            ledger = Ledger(conn)
            now = self.clock()
            loaded = await ledger.load(row.operation_id, evidence=True)
            assert loaded is not None
            operation, last = loaded.operation, loaded.last_attempt
            judgement = judge_lookup(lookup, last.submitted_at if last else None, now)
            answer = lookup.answer
            retry_after = parse_retry_after(answer.retry_after, now)
            planned = changes.Writes(now)
            observation = planned.observe(
                operation_id=operation.operation_id,
                actor=operation.actor,
                at=now,
                kind=kind,
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
                detail=lookup_detail(lookup),
            )
            planned.finish(row.id)
            evidence = LookupResult(
                judgement.verdict,
                judgement.reason,
                executed=judgement.executed,
                failed=judgement.failed,
                retry_after=retry_after,
                audit=kind == "audit_lookup",
                visible_at=judgement.visible_at,
                open=judgement.open,
                lag=lookup.lag,
                complete=judgement.complete,
                looked_at=looked_at,
            )
            rules = self.rules_for(operation.provider)
            await weigh(
                ledger,
                operation,
                evidence,
                now=now,
                limits=Limits.of(rules, self.recheck_backoff, self.jitter()),
                source=self.worker_id,
                review=self._review,
                observation_id=observation,
                writes=planned,
                loaded=loaded,
            )

    async def _review(
        self, ledger: Ledger, operation: OperationRecord, now: datetime, reason: str, status: str
    ) -> None:
        checks = len(await ledger.lookups_of(operation.operation_id))
        delay = recheck_delay(checks, self.recheck_backoff, jitter=self.jitter())
        await run_safety_review(
            ledger,
            operation,
            now=now,
            policy=self.policy_for(operation.provider),
            rules=self.rules_for(operation.provider),
            source=self.worker_id,
            reason=reason,
            reconciliation_status=status,
            recheck_at=now + delay,
        )


def lookup_detail(lookup: LookupAnswer) -> dict[str, Any]:
    """What a lookup showed, for the record: each charge in the adapter's word
    and the provider's own, how it looked, and the provider's request id."""
    detail: dict[str, Any] = {
        "charges": [
            {"reference": c.provider_reference, "status": c.status}
            | ({"raw_status": c.raw_status} if c.raw_status and c.raw_status != c.status else {})
            for c in lookup.charges
        ]
    }
    if lookup.method:
        detail["method"] = lookup.method
    if lookup.lag is not None:
        detail["lag_seconds"] = lookup.lag.total_seconds()
    if not lookup.complete:
        detail["complete"] = False
    request_id = lookup.answer.detail.get("request-id")
    if request_id:
        detail["request_id"] = request_id
    return detail


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else "now"
