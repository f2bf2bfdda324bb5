"""Refusals: requests the rules do not allow, and the one idempotency check.

A refusal is raised inside the transaction that would have written the
request, so nothing is written for it and its Idempotency-Key stays unused.
The API turns every refusal into a problem+json answer with its status.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Protocol, TypeVar

from sqlalchemy.exc import IntegrityError

from intentledger.domain.durations import format_duration
from intentledger.domain.replay_window import replay_window_passed
from intentledger.store.direct import engine_connection
from intentledger.store.intake import IntakeLedger
from intentledger.store.ledger import Ledger
from intentledger.store.records import IdempotencyRecord

T = TypeVar("T")
# Losing a race for a key costs one retry; more than a few means something else.
_MAX_KEY_RACES = 3


class Refusal(Exception):
    def __init__(
        self, status: int, slug: str, detail: str, retry_after_seconds: int | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.detail = detail
        # When asking again is worth it (an answer still being made).
        self.retry_after_seconds = retry_after_seconds


class IdempotencyKeyReused(Refusal):
    """The key was used for a different request by this actor on this route."""

    def __init__(self, resource_id: str) -> None:
        super().__init__(
            409,
            "idempotency-key-reused",
            "this Idempotency-Key was already used with a different request",
        )
        self.resource_id = resource_id


class KeyExpired(Refusal):
    """The key was first used longer ago than the replay window (decision 0018)."""

    def __init__(self, resource_id: str, first_used_at: datetime, window: timedelta) -> None:
        super().__init__(
            409,
            "key-expired",
            f"this Idempotency-Key was first used at {first_used_at.isoformat()}, longer ago "
            f"than the replay window ({format_duration(window)}): it replays no more and is "
            "never used again; a new request needs a new key",
        )
        self.resource_id = resource_id


async def find_replay(
    ledger: Ledger,
    actor: str,
    route: str,
    key: str,
    request_hash: str,
    now: datetime,
    window: timedelta,
) -> str | None:
    """The resource an equal earlier request made, None for a first request;
    IdempotencyKeyReused when the key came with a different request, KeyExpired
    when it was first used longer ago than `window`."""
    existing = await ledger.find_idempotency_record(actor, route, key)
    if existing is None:
        return None
    return replay_of(existing, request_hash, now, window)


class IdempotencyClaim(Protocol):
    """A request's idempotency claim, as every keyed route makes one."""

    @property
    def actor(self) -> str: ...
    @property
    def route(self) -> str: ...
    @property
    def idempotency_key(self) -> str: ...
    @property
    def request_hash(self) -> str: ...
    @property
    def replay_window(self) -> timedelta: ...


async def find_keyed_replay(ledger: Ledger, keyed: IdempotencyClaim, now: datetime) -> str | None:
    """`find_replay` for a keyed request."""
    return await find_replay(
        ledger,
        keyed.actor,
        keyed.route,
        keyed.idempotency_key,
        keyed.request_hash,
        now,
        keyed.replay_window,
    )


def replay_of(
    existing: IdempotencyRecord, request_hash: str, now: datetime, window: timedelta
) -> str:
    """What an equal earlier request made with this key; IdempotencyKeyReused
    when the key's record is for a different request; KeyExpired, whatever the
    request, once the key's replay window has passed."""
    if replay_window_passed(existing.created_at, now, window):
        raise KeyExpired(existing.resource_id, existing.created_at, window)
    if existing.request_hash != request_hash:
        raise IdempotencyKeyReused(existing.resource_id)
    return str(existing.resource_id)


async def claim_key(
    ledger: Ledger,
    actor: str,
    route: str,
    key: str,
    request_hash: str,
    resource_id: str,
    now: datetime,
) -> None:
    """Write the idempotency record before anything else the request locks or
    checks. A concurrent equal request then waits on the unique key, fails when
    this one commits, and comes round again as a replay instead of being judged
    against state this request already changed."""
    await ledger.add_idempotency_record(actor, route, key, request_hash, resource_id, now)


async def claim_or_replay(
    ledger: Ledger,
    actor: str,
    route: str,
    key: str,
    request_hash: str,
    resource_id: str,
    now: datetime,
    window: timedelta,
) -> str | None:
    """Claim the key for `resource_id` (None), or find what an equal earlier
    request made with it (its resource id); IdempotencyKeyReused when the key
    came with a different request.

    Like `claim_key`, call it before anything else the request locks or
    checks. The claim is one INSERT that does nothing if the key has a record;
    only then is the record read. On PostgreSQL that INSERT waits for a
    concurrent transaction holding an uncommitted claim of the same key: if it
    commits, the read that follows (a new snapshot under READ COMMITTED) sees
    its record and this request is a replay; if it rolls back, this request
    claims the key. On SQLite, BEGIN IMMEDIATE runs the two one after the
    other. Either way a lost race needs no retry of the transaction.
    """
    # Records are never deleted; the loop only guards against one vanishing
    # between the INSERT and the read, which would free the key again.
    for _ in range(_MAX_KEY_RACES):
        record = {
            "actor": actor,
            "route": route,
            "idempotency_key": key,
            "request_hash": request_hash,
            "resource_id": resource_id,
            "created_at": now,
        }
        if await IntakeLedger(engine_connection(ledger.conn)).claim_keys([record]):
            return None
        original = await find_replay(ledger, actor, route, key, request_hash, now, window)
        if original is not None:
            return original
    raise RuntimeError("idempotency key race did not settle")


async def retry_key_races(attempt: Callable[[], Awaitable[T]]) -> T:
    """Run a keyed transaction, again if it lost the race for its key."""
    for _ in range(_MAX_KEY_RACES):
        try:
            return await attempt()
        except IntegrityError:
            continue
    raise RuntimeError("idempotency key race did not settle")
