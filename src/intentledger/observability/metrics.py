"""The process's metrics, in prometheus_client's default registry.

Cardinality is bounded by construction: every label value comes from a closed
set the code owns (states, kinds, verdicts, rules, installed providers), never
from a request. No operation id, actor, key, URL or amount is ever a label.

Counts of rows a transaction writes (transitions, decisions, sweeps, lease
take-overs, group sizes) are kept pending on the connection by `after_commit`
and applied when that transaction commits; a rollback drops them, so a retried
or failed transaction is not counted twice or at all. They are applied at the
commit event, which SQLAlchemy fires as COMMIT is sent: a commit cut off at that
very moment may or may not have happened, and is counted — the metric then errs
like the database itself is ambiguous, once, and the ledger's tables (and the
scrape-time gauges read from them, observability/ledger_gauges.py) stay the truth.
On the batched first attempts' own connections (store/direct.py) they are
applied once COMMIT has answered, so such a commit cut off is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from intentledger.store.direct import DirectConnection

# -- counted where the work is written (applied at commit) -------------------

TRANSITIONS = Counter(
    "intentledger_transitions_total",
    "State transitions committed, by state before (none: a new operation) and after.",
    ["from_state", "to_state"],
)
DECISIONS = Counter(
    "intentledger_decisions_total",
    "Decision rows committed (safety review, non-execution requeue, operator action), by rule.",
    ["rule"],
)
SWEEPER_ACTIONS = Counter(
    "intentledger_sweeper_actions_total",
    "What the sweeper committed, by action (stale SUBMITTING made UNKNOWN).",
    ["action"],
)
LEASE_EXPIRIES = Counter(
    "intentledger_lease_expiries_total",
    "Rows claimed again after an earlier holder's lease ran out before it finished them "
    "(a crashed or stalled worker, or a request that outlived its hold), by queue.",
    ["queue"],
)
GROUP_COMMIT_SIZE = Histogram(
    "intentledger_group_commit_size",
    "Operations written by one grouped transaction, by stage (intake, pre_submit, settle).",
    ["stage"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
GROUP_RECORDS_REPLANNED = Counter(
    "intentledger_group_records_replanned_total",
    "Group records of first attempts' answers planned from the operations as their "
    "pre-submits left them, in which an operation had moved on (a webhook, an operator): "
    "written not at all, then planned again from the rows read under their locks.",
)
RECORD_DELAY_SECONDS = Histogram(
    "intentledger_record_delay_seconds",
    "From a provider's answer arriving to its outcome's transaction having committed, by "
    "operation kind and what recorded it (grouped: settled with the answers that arrived "
    "beside it; alone: the reference path). Observed only once the commit returned: an "
    "answer held in memory is one a crash turns into UNKNOWN.",
    ["kind", "recorded_by"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)

# -- counted where the call or request is made ---------------------------------
# A provider call, a webhook received or sent happened whatever a later
# transaction does, so these count when they happen.

PROVIDER_CALL_SECONDS = Histogram(
    "intentledger_provider_call_seconds",
    "Provider calls, from send to answer (or to giving up on one), by provider, call "
    "(submit, lookup), operation kind and verdict (a submit's classification, a lookup's "
    "finding).",
    ["provider", "call", "kind", "verdict"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CLASSIFICATIONS = Counter(
    "intentledger_classifications_total",
    "Submit answers as classified (the transport, and what the adapter's mapping proves), "
    "by provider, operation kind, transport and verdict.",
    ["provider", "kind", "transport", "verdict"],
)
LOOKUPS = Counter(
    "intentledger_lookups_total",
    "Lookups by our reference, by provider, operation kind and what they showed.",
    ["provider", "kind", "verdict"],
)
WEBHOOKS_IN = Counter(
    "intentledger_provider_webhooks_total",
    "Provider webhooks received, by provider (a configured one) and result "
    "(verified, duplicate, rejected, unreadable).",
    ["provider", "result"],
)
PROVIDER_EVENTS_FLAGGED = Counter(
    "intentledger_provider_events_flagged_total",
    "Provider events a person must see (Adyen's CHARGEBACK), recorded on the operation "
    "they name, by provider.",
    ["provider"],
)
WEBHOOKS_OUT = Counter(
    "intentledger_merchant_webhook_attempts_total",
    "Merchant webhook attempts recorded, by result (delivered, failed: tried again later, "
    "gave_up: no more retries).",
    ["result"],
)
REAPED = Counter(
    "intentledger_reaped_total",
    "What record retention removed (decision 0018), by what: operations reaped, "
    "observation details deleted (SQLite), done outbox rows deleted, partitions "
    "of observation details dropped and details moved out of them first (PostgreSQL).",
    ["what"],
)

# -- a worker's own load ---------------------------------------------------------

WORKER_CONCURRENCY_LIMIT = Gauge(
    "intentledger_worker_concurrency_limit",
    "Provider calls this worker process may have in flight now: its adaptive limit, "
    "at most the configured concurrency (domain/concurrency_limit.py).",
)
EVENT_LOOP_LAG = Histogram(
    "intentledger_event_loop_lag_seconds",
    "How late this process's event loop ran a timer, sampled every 50 ms: the wait "
    "of every ready callback, a provider call's answer among them.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)

# The label names every metric of ours may carry: a test holds the set to this.
LABEL_NAMES = frozenset(
    {
        "from_state",
        "to_state",
        "rule",
        "action",
        "queue",
        "stage",
        "provider",
        "call",
        "kind",
        "transport",
        "verdict",
        "result",
        "state",
        "flag",
        "what",
        "recorded_by",
    }
)

_PENDING = "intentledger.metrics.after_commit"


def after_commit(
    conn: AsyncConnection | Connection | DirectConnection, action: Callable[[], Any]
) -> None:
    """Run `action` when the connection's current transaction commits; never if it
    rolls back. For counts (and log lines) of what a transaction writes."""
    if isinstance(conn, DirectConnection):
        conn.after_commit(action)
        return
    sync = conn.sync_connection if isinstance(conn, AsyncConnection) else conn
    assert sync is not None, "a connection in use has its sync side"
    sync.info.setdefault(_PENDING, []).append(action)


def _take_pending(conn: Connection) -> list[Callable[[], Any]]:
    try:
        pending: list[Callable[[], Any]] = conn.info.pop(_PENDING, [])
    except SQLAlchemyError:
        # An invalidated connection has no info left; nothing of it committed.
        return []
    return pending


@event.listens_for(Engine, "commit")
def _apply_pending(conn: Connection) -> None:
    for action in _take_pending(conn):
        action()


@event.listens_for(Engine, "rollback")
@event.listens_for(Engine, "begin")
def _drop_pending(conn: Connection) -> None:
    # On begin too: `info` belongs to the pooled DBAPI connection, so nothing
    # of an earlier checkout may leak into this transaction's count.
    _take_pending(conn)
