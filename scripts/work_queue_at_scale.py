"""How fast the console's work queue pages on a ledger of a million operations.

    scripts/with-postgres .venv/bin/python scripts/work_queue_at_scale.py [--operations N]

Builds a fresh database on each backend (a throwaway SQLite file, and a new
database on INTENTLEDGER_TEST_POSTGRES_URL when it is set), migrated to head,
holding N operations of which 1 in 500 (--in-queue-every) needs a person, then times the queue's
first page, a page 20 pages deep (keyset paging), a filtered page and the
counts, each the median of 7 runs. docs/operations.md records its output.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.work_queue import Cursor
from intentledger.store.database import create_ledger_engine
from intentledger.store.migrate import upgrade
from intentledger.store.work_queue import QueueFilter, work_queue

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
THRESHOLD = timedelta(minutes=15)
RUNS = 7


def fill_sql(dialect: str, operations: int, every: int) -> str:
    """One INSERT ... SELECT: every `every`-th operation in MANUAL_REVIEW, the rest
    settled, created one second apart, spread over ten actors."""
    if dialect == "postgresql":
        series = f"generate_series(1, {operations}) AS g(n)"
        created = "TIMESTAMPTZ '2026-11-01 00:00:00+00' + n * INTERVAL '1 second'"
        context = "'{}'::jsonb"
    else:
        series = (
            "(WITH RECURSIVE g(n) AS (SELECT 1 UNION ALL "
            f"SELECT n + 1 FROM g WHERE n < {operations}) SELECT n FROM g)"
        )
        created = "strftime('%Y-%m-%d %H:%M:%f', '2026-11-01', '+' || n || ' seconds')"
        context = "'{}'"
    return f"""
        INSERT INTO operations (operation_id, idempotency_key, state, request_context,
            next_action, actor, route, kind, request_hash, provider, amount, currency,
            version, created_at, updated_at, duplicate_detected, outcome_contradicted, outcome)
        SELECT 'op_' || n, 'k' || n,
            CASE WHEN n % {every} = 0 THEN 'MANUAL_REVIEW' ELSE 'OUTCOME_KNOWN' END,
            {context},
            CASE WHEN n % {every} = 0 THEN 'operator' ELSE 'none' END,
            'actor-' || (n % 10), 'POST /v1/payments', 'payment', 'h', 'sandbox', 990, 'EUR',
            1, {created}, {created}, false, false,
            CASE WHEN n % {every} = 0 THEN NULL ELSE 'succeeded' END
        FROM {series}
    """


async def timed(engine: AsyncEngine, chosen: QueueFilter, after: Cursor | None) -> float:
    samples = []
    for _ in range(RUNS):
        async with engine.connect() as conn:
            started = time.perf_counter()
            await work_queue(conn, NOW, THRESHOLD, chosen, after, 50)
            samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


async def measure(url: str, operations: int, every: int) -> None:
    upgrade(url)
    engine = create_ledger_engine(url)
    started = time.perf_counter()
    async with engine.begin() as conn:
        await conn.execute(text(fill_sql(engine.dialect.name, operations, every)))
        if engine.dialect.name == "postgresql":
            await conn.execute(text("ANALYZE operations"))
    filled = time.perf_counter() - started
    cursor = None
    async with engine.connect() as conn:
        for _ in range(20):
            page = await work_queue(conn, NOW, THRESHOLD, QueueFilter(), cursor, 50)
            cursor = page.next_cursor
        queue_size = page.total
    first = await timed(engine, QueueFilter(), None)
    deep = await timed(engine, QueueFilter(), cursor)
    filtered = await timed(engine, QueueFilter(actor="actor-0", older_than=timedelta(days=1)), None)
    await engine.dispose()
    print(
        f"{engine.dialect.name:10} {operations:>9} operations ({queue_size} in the queue, "
        f"filled in {filled:.0f} s): first page {first:.1f} ms, page 21 {deep:.1f} ms, "
        f"filtered (actor, older than 1d) {filtered:.1f} ms — each with the counts, "
        f"median of {RUNS}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operations", type=int, default=1_000_000)
    parser.add_argument(
        "--in-queue-every", type=int, default=500, help="1 in this many needs a person"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        sqlite_url = f"sqlite:///{Path(folder) / 'queue.db'}"
        await measure(sqlite_url, args.operations, args.in_queue_every)
    server = os.environ.get("INTENTLEDGER_TEST_POSTGRES_URL")
    if server:
        name = f"queue_at_scale_{os.getpid()}"
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")  # type: ignore[arg-type]
        try:
            url = make_url(server).set(database=name).render_as_string(hide_password=False)
            await measure(url, args.operations, args.in_queue_every)
        finally:
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE {name}")  # type: ignore[arg-type]


if __name__ == "__main__":
    asyncio.run(main())
