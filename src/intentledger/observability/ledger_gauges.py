"""The ledger's state, read from the database when the API's /metrics is scraped.

Only the API process exports these: every process reads the same database, so
each would report the same numbers (and a worker has no business holding a
scrape open on it). Each query is bounded by what needs attention, never by the
size of the ledger, through an index (the statements are store/ledger_state.py's):

- unresolved operations by state and kind, and the oldest per state: the
  operations' (state, updated_at) index, over the unresolved states only (final
  states grow for ever; `intentledger_transitions_total` counts arrivals there);
- flagged operations: the partial index of flagged rows (migration 0011);
- the oldest due-but-unclaimed outbox row and merchant webhook delivery: the
  partial indexes of pending rows by due time, read at their first entry;
- operator actions by rule: the partial index of decisions a person made
  (migration 0018). These are a counter read from the table rather than counted
  in a process, because `intentledger ops` acts from a process no one scrapes:
  the decision rows are where every operator action, from the console, the API
  or the CLI, is written, and they are never reaped, so the count only rises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.states import FINAL, State
from intentledger.store import ledger_state as reads

log = logging.getLogger(__name__)

UNRESOLVED = tuple(state for state in State if state not in FINAL)


@dataclass
class LedgerState:
    readable: bool = True
    # (state, kind) -> count, and state -> seconds since the oldest was created.
    unresolved: dict[tuple[str, str], int] = field(default_factory=dict)
    oldest_seconds: dict[str, float] = field(default_factory=dict)
    flagged: dict[str, int] = field(default_factory=dict)
    outbox_due_seconds: float = 0.0
    webhook_due_seconds: float = 0.0
    # rule -> operator actions ever recorded under it.
    operator_actions: dict[str, int] = field(default_factory=dict)
    # The PostgreSQL server read (None on SQLite).
    server: reads.DatabaseServer | None = None


async def read_ledger_state(engine: AsyncEngine, now: datetime) -> LedgerState:
    state = LedgerState()
    async with engine.connect() as conn:
        for row_state, kind, count, oldest in await reads.unresolved_counts(conn, UNRESOLVED):
            state.unresolved[(row_state, kind)] = count
            age = _age(now, oldest)
            state.oldest_seconds[row_state] = max(state.oldest_seconds.get(row_state, 0.0), age)
        state.flagged = await reads.flag_counts(conn)
        state.outbox_due_seconds = _age(now, await reads.oldest_due_outbox(conn, now))
        state.webhook_due_seconds = _age(now, await reads.oldest_due_delivery(conn, now))
        state.operator_actions = await reads.operator_action_counts(conn)
    try:
        async with engine.connect() as conn:
            state.server = await reads.database_server(conn)
    except Exception:
        # A server that will not say (a function revoked, an engine that is
        # PostgreSQL on the wire only): those gauges are absent, the ledger's
        # own readings stand.
        log.warning("could not read the database server's replication settings", exc_info=True)
    return state


def _age(now: datetime, since: datetime | str | None) -> float:
    if since is None:
        return 0.0
    if isinstance(since, str):  # an aggregate over SQLite's text timestamps
        since = datetime.fromisoformat(since)
    if since.tzinfo is None:
        since = since.replace(tzinfo=now.tzinfo)
    return max(0.0, (now - since).total_seconds())


class LedgerCollector(Collector):
    """One scrape's reading, as gauges (built fresh for each scrape)."""

    def __init__(self, reading: LedgerState) -> None:
        self.reading = reading

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        reading = self.reading
        yield GaugeMetricFamily(
            "intentledger_ledger_readable",
            "1 if this scrape could read the ledger's state from the database, else 0.",
            value=1 if reading.readable else 0,
        )
        if not reading.readable:
            return
        operations_family = GaugeMetricFamily(
            "intentledger_operations",
            "Unresolved operations (not OUTCOME_KNOWN or CANCELLED) by state and kind.",
            labels=["state", "kind"],
        )
        for (state, kind), count in sorted(reading.unresolved.items()):
            operations_family.add_metric([state, kind], count)
        yield operations_family
        oldest = GaugeMetricFamily(
            "intentledger_oldest_unresolved_age_seconds",
            "Age (since it was accepted) of the oldest operation in each unresolved state; "
            "0 when there is none.",
            labels=["state"],
        )
        for state in UNRESOLVED:
            oldest.add_metric([state], reading.oldest_seconds.get(state, 0.0))
        yield oldest
        flagged = GaugeMetricFamily(
            "intentledger_flagged_operations",
            "Operations carrying a flag a person must clear, by flag.",
            labels=["flag"],
        )
        for flag, count in sorted(reading.flagged.items()):
            flagged.add_metric([flag], count)
        yield flagged
        yield GaugeMetricFamily(
            "intentledger_outbox_due_age_seconds",
            "How long the oldest due outbox row (submit, reconcile, audit) has waited "
            "unclaimed; 0 when none is due.",
            value=reading.outbox_due_seconds,
        )
        yield GaugeMetricFamily(
            "intentledger_webhook_due_age_seconds",
            "How long the oldest due merchant webhook delivery has waited unclaimed.",
            value=reading.webhook_due_seconds,
        )
        actions = CounterMetricFamily(
            "intentledger_operator_actions",
            "Operator actions recorded (a person's decision: resolve, approve a new request, "
            "escalate, refund a duplicate), by rule, whoever took them: console, API or "
            "`intentledger ops`. Read from the ledger's decisions at each scrape.",
            labels=["rule"],
        )
        for rule, count in sorted(reading.operator_actions.items()):
            actions.add_metric([rule], count)
        yield actions
        if reading.server is not None:
            yield from _database_server_gauges(reading.server)


def _database_server_gauges(server: reads.DatabaseServer) -> Iterator[GaugeMetricFamily]:
    yield GaugeMetricFamily(
        "intentledger_database_server_start_time_seconds",
        "When the PostgreSQL server this process reads was started (Unix time): another "
        "value after a restart, and after a failover to another node.",
        value=server.started_at.timestamp(),
    )
    yield GaugeMetricFamily(
        "intentledger_database_commits_wait_for_standby",
        "1 if the ledger's commits wait for a synchronous standby (synchronous_standby_names "
        "set, synchronous_commit on, remote_write or remote_apply), else 0: a commit then "
        "lives on one machine only.",
        value=1 if server.commits_wait_for_standby else 0,
    )
    if server.synchronous_standbys is not None:
        yield GaugeMetricFamily(
            "intentledger_database_synchronous_standbys",
            "Standbys replicating synchronously (sync or quorum) now. Absent when the "
            "database role may not read it (grant it pg_monitor).",
            value=server.synchronous_standbys,
        )
