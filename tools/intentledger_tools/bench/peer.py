"""The peer: the same payment flow built on Procrastinate, as a Python team would write it.

A `payments` table, a `charge` task deferred per payment, and a worker that
loads the payment, POSTs the charge to the sandbox with an idempotency key and
records the answer. It lives in its own PostgreSQL schema (`bench_peer`) of
the bench's database, with Procrastinate's schema applied there.

    python -m intentledger_tools.bench.peer --database-url URL --sandbox-url URL --concurrency 16

Procrastinate is a bench-only extra (`pip install -e '.[bench]'`), never a
runtime dependency of intentledger.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import procrastinate  # type: ignore[import-not-found,unused-ignore]
import psycopg
import psycopg_pool  # type: ignore[import-not-found,unused-ignore]

from intentledger import eventloop
from intentledger_tools.bench.peer_payments import PAYMENTS_TABLE

SCHEMA = "bench_peer"
TASK = "charge_payment"


def version() -> str:
    from importlib.metadata import version as installed

    return f"procrastinate {installed('procrastinate')}"


def _connect_kwargs() -> dict[str, Any]:
    return {"options": f"-c search_path={SCHEMA}"}


@dataclass
class Resources:
    """What the task needs, opened by the worker process."""

    pool: Any = None
    http: httpx.AsyncClient | None = None


resources = Resources()


async def charge_payment(payment_id: int) -> None:
    pool, http = resources.pool, resources.http
    assert pool is not None and http is not None, "the worker opens these first"
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT amount, currency, payment_method FROM payments WHERE id = %s", (payment_id,)
        )
        amount, currency, payment_method = await cursor.fetchone()
    response = await http.post(
        "/v1/charges",
        json={
            "reference": f"peer_{payment_id}",
            "amount": amount,
            "currency": currency,
            "payment_method": payment_method,
        },
        headers={"Idempotency-Key": f"peer-{payment_id}"},
    )
    status = "succeeded" if response.status_code == 200 else f"failed_{response.status_code}"
    reference = response.json().get("id") if response.status_code == 200 else None
    async with pool.connection() as conn:
        await conn.execute(
            "UPDATE payments SET status = %s, provider_reference = %s, updated_at = now() "
            "WHERE id = %s",
            (status, reference, payment_id),
        )


# Retried as a team would retry an HTTP call, five attempts in all like the
# DBOS peer's (Procrastinate counts the retries; the idempotency key makes it
# safe): now and then the sandbox resets a kept-alive connection as a call
# goes out on it (httpx keeps one idle as long as uvicorn does, 5 s), and a
# job that failed once left its payment pending and the bench waiting for it
# until its deadline.
RETRY = procrastinate.RetryStrategy(max_attempts=4, retry_exceptions={httpx.TransportError})


def make_app(libpq_url: str) -> Any:
    connector = procrastinate.PsycopgConnector(conninfo=libpq_url, kwargs=_connect_kwargs())
    app = procrastinate.App(connector=connector)
    app.task(name=TASK, retry=RETRY)(charge_payment)
    return app


# -- set-up and load, from the bench process --------------------------------------------------


def create_schema(libpq_url: str) -> None:
    """A fresh `bench_peer` schema with Procrastinate's tables and the payments table."""
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE".encode())
        conn.execute(f"CREATE SCHEMA {SCHEMA}".encode())
    with psycopg.connect(libpq_url, autocommit=True, **_connect_kwargs()) as conn:
        conn.execute(PAYMENTS_TABLE.encode())

    async def apply() -> None:
        app = make_app(libpq_url)
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    asyncio.run(apply())


def drop_schema(libpq_url: str) -> None:
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE".encode())


def enqueue_payments(libpq_url: str, count: int, payment_method: str = "pm_ok") -> None:
    """Persist `count` payments and defer one job each, in one transaction (Procrastinate
    defers on the caller's connection), so they all become visible at one commit."""

    async def load() -> None:
        app = make_app(libpq_url)
        async with (
            app.open_async(),
            app.connector.pool.connection() as conn,
            conn.transaction(),
        ):
            cursor = await conn.execute(
                "INSERT INTO payments (idempotency_key, amount, currency, payment_method) "
                "SELECT 'peer-key-' || g, 1250, 'EUR', %s FROM generate_series(1, %s) AS g "
                "RETURNING id",
                (payment_method, count),
            )
            ids = [row[0] for row in await cursor.fetchall()]
            deferrer = app.configure_task(TASK, connection=conn)
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                await deferrer.batch_defer_async(*({"payment_id": i} for i in chunk))
            # In the load's own transaction, as the bench does for our seeds: the
            # tables are new, and unanalyzed they cost their server about three
            # times its CPU until autovacuum's first look (bench/workloads.py).
            await conn.execute("ANALYZE payments, procrastinate_jobs, procrastinate_events")

    asyncio.run(load())


def settled(libpq_url: str) -> tuple[int, int]:
    """(payments no longer pending, of which succeeded)."""
    with psycopg.connect(libpq_url, **_connect_kwargs()) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status <> 'pending'), "
            "count(*) FILTER (WHERE status = 'succeeded') FROM payments"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# -- the worker process -----------------------------------------------------------------------


async def run_worker(libpq_url: str, sandbox_url: str, concurrency: int) -> None:
    pool = psycopg_pool.AsyncConnectionPool(
        libpq_url, kwargs=_connect_kwargs(), min_size=2, max_size=concurrency + 4, open=False
    )
    await pool.open(wait=True)
    resources.pool = pool
    resources.http = httpx.AsyncClient(base_url=sandbox_url, timeout=10.0)
    app = make_app(libpq_url)
    try:
        async with app.open_async(pool):
            print("peer worker ready", file=sys.stderr, flush=True)
            await app.run_worker_async(concurrency=concurrency, install_signal_handlers=True)
    finally:
        await resources.http.aclose()
        await pool.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A Procrastinate worker for the bench's peer.")
    parser.add_argument("--database-url", required=True, help="a libpq URL")
    parser.add_argument("--sandbox-url", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    # The same event loop as our workers (intentledger.eventloop), its start
    # frozen as theirs is: the comparison is between the two designs, not
    # between event loops or collectors.
    eventloop.freeze_what_starts_with_the_process()
    eventloop.run(run_worker(args.database_url, args.sandbox_url, args.concurrency))


if __name__ == "__main__":
    main()
