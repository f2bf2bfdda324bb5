"""The second peer: the same payment flow on DBOS Transact, as a Python team would write it.

A `payments` table and, in the same transaction as its rows, one enqueued
`charge_payment` workflow per payment (`DBOSClient.enqueue_in_transaction`: the
payments and DBOS's system tables share one database for that). The workflow's
one step loads the payment, POSTs the charge to the sandbox with an
idempotency key and records the answer; DBOS checkpoints the step's result and
the workflow's outcome in its system tables. The payments table lives in the
schema `bench_dbos`, DBOS's system tables in `bench_dbos_sys`, both in the
bench's database and both dropped afterwards.

    python -m intentledger_tools.bench.peer_dbos --database-url URL --sandbox-url URL \\
        --concurrency 128 --executor-id dbos0

Workflows run as DBOS runs plain functions: each on a thread of its executor,
the worker process's queue claiming up to `--concurrency` of them at once,
polling every 0.1 s (DBOS's default is 1 s). DBOS is a bench-only extra
(`pip install -e '.[bench]'`), never a runtime dependency of intentledger.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import psycopg
import psycopg_pool  # type: ignore[import-not-found,unused-ignore]
import sqlalchemy as sa
from dbos import DBOS, DBOSClient, DBOSConfig, EnqueueOptions

from intentledger_tools.bench.peer_payments import PAYMENTS_TABLE

SCHEMA = "bench_dbos"
SYSTEM_SCHEMA = "bench_dbos_sys"
APP_NAME = "intentledger-bench-peer"
# Set rather than hashed from the code: the queue only hands a workflow to an
# executor of the version it was enqueued with.
APP_VERSION = "bench"
QUEUE = "payments"
WORKFLOW = "charge_payment"
# How often a worker's queue looks for workflows to start (DBOS's default: 1 s).
POLLING_SECONDS = 0.1


def version() -> str:
    from importlib.metadata import version as installed

    return f"dbos {installed('dbos')}"


def sqlalchemy_url(libpq_url: str) -> str:
    return sa.make_url(libpq_url).set(drivername="postgresql+psycopg").render_as_string(False)


def _connect_kwargs() -> dict[str, Any]:
    return {"options": f"-c search_path={SCHEMA}"}


@dataclass
class Resources:
    """What the step needs, opened by the worker process before DBOS launches."""

    pool: Any = None
    http: httpx.Client | None = None


resources = Resources()


# Retried as a team would retry an HTTP call (the idempotency key makes it safe): on a
# busy machine a connection to the sandbox is now and then reset.
@DBOS.step(name="charge", retries_allowed=True, max_attempts=5, interval_seconds=0.1)
def charge(payment_id: int) -> dict[str, Any]:
    pool, http = resources.pool, resources.http
    assert pool is not None and http is not None, "the worker opens these first"
    with pool.connection() as conn:
        row = conn.execute(
            "SELECT amount, currency, payment_method FROM payments WHERE id = %s", (payment_id,)
        ).fetchone()
    assert row is not None, payment_id
    amount, currency, payment_method = row
    response = http.post(
        "/v1/charges",
        json={
            "reference": f"dbos_{payment_id}",
            "amount": amount,
            "currency": currency,
            "payment_method": payment_method,
        },
        headers={"Idempotency-Key": f"dbos-{payment_id}"},
    )
    status = "succeeded" if response.status_code == 200 else f"failed_{response.status_code}"
    reference = response.json().get("id") if response.status_code == 200 else None
    with pool.connection() as conn:
        conn.execute(
            "UPDATE payments SET status = %s, provider_reference = %s, updated_at = now() "
            "WHERE id = %s",
            (status, reference, payment_id),
        )
    return {"status": status, "reference": reference}


@DBOS.workflow(name=WORKFLOW)
def charge_payment(payment_id: int) -> str:
    return str(charge(payment_id)["status"])


def config(libpq_url: str, *, executor_id: str | None = None, pool_size: int = 20) -> DBOSConfig:
    cfg: DBOSConfig = {
        "name": APP_NAME,
        "system_database_url": sqlalchemy_url(libpq_url),
        "dbos_system_schema": SYSTEM_SCHEMA,
        "application_version": APP_VERSION,
        "sys_db_pool_size": pool_size,
        "log_level": "WARNING",
    }
    if executor_id is not None:
        cfg["executor_id"] = executor_id
    return cfg


# -- set-up and load, from the bench process --------------------------------------------------


def drop_schema(libpq_url: str) -> None:
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE".encode())
        conn.execute(f"DROP SCHEMA IF EXISTS {SYSTEM_SCHEMA} CASCADE".encode())


def create_schema(libpq_url: str) -> None:
    """Fresh `bench_dbos` (the payments table) and `bench_dbos_sys` (DBOS's tables,
    made by DBOS's own migrations) schemas."""
    drop_schema(libpq_url)
    with psycopg.connect(libpq_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {SCHEMA}".encode())
    with psycopg.connect(libpq_url, autocommit=True, **_connect_kwargs()) as conn:
        conn.execute(PAYMENTS_TABLE.encode())
    DBOS.migrate(sqlalchemy_url(libpq_url), schema=SYSTEM_SCHEMA)


def enqueue_payments(libpq_url: str, count: int, payment_method: str = "pm_ok") -> None:
    """Persist `count` payments and enqueue one workflow each, in one transaction on the
    database DBOS's system tables live in, so they all become visible at one commit."""
    engine = sa.create_engine(sqlalchemy_url(libpq_url), pool_size=1)
    client = DBOSClient(
        system_database_engine=engine,
        dbos_system_schema=SYSTEM_SCHEMA,
        application_name=APP_NAME,
    )
    options: EnqueueOptions = {
        "workflow_name": WORKFLOW,
        "queue_name": QUEUE,
        "app_version": APP_VERSION,
    }
    try:
        with engine.begin() as conn:
            ids = conn.execute(
                sa.text(
                    f"INSERT INTO {SCHEMA}.payments "
                    "(idempotency_key, amount, currency, payment_method) "
                    "SELECT 'dbos-key-' || g, 1250, 'EUR', :method "
                    "FROM generate_series(1, :count) AS g RETURNING id"
                ),
                {"method": payment_method, "count": count},
            ).scalars()
            for payment_id in list(ids):
                client.enqueue_in_transaction(
                    conn, {**options, "workflow_id": f"payment-{payment_id}"}, payment_id
                )
            # In the load's own transaction, as the bench does for our seeds: the
            # tables are new, and unanalyzed they cost their server about three
            # times its CPU until autovacuum's first look (bench/workloads.py).
            conn.execute(
                sa.text(
                    f"ANALYZE {SCHEMA}.payments, {SYSTEM_SCHEMA}.workflow_status, "
                    f"{SYSTEM_SCHEMA}.workflow_input"
                )
            )
    finally:
        client.destroy()
        engine.dispose()


def settled(libpq_url: str) -> tuple[int, int]:
    """(payments no longer pending or whose workflow failed, of which succeeded)."""
    with psycopg.connect(libpq_url, **_connect_kwargs()) as conn:
        row = conn.execute(
            f"SELECT count(*) FILTER (WHERE p.status <> 'pending' OR w.status = 'ERROR'), "
            "count(*) FILTER (WHERE p.status = 'succeeded') FROM payments p "
            f"LEFT JOIN {SYSTEM_SCHEMA}.workflow_status w "
            "ON w.workflow_uuid = 'payment-' || p.id".encode()
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def workflows_succeeded(libpq_url: str) -> int:
    """Workflows DBOS itself records as done (the step's answer checkpointed)."""
    with psycopg.connect(libpq_url) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {SYSTEM_SCHEMA}.workflow_status "
            "WHERE status = 'SUCCESS'".encode()
        ).fetchone()
    return int(row[0]) if row is not None else 0


# -- the worker process -----------------------------------------------------------------------


def run_worker(libpq_url: str, sandbox_url: str, concurrency: int, executor_id: str) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Connections: the server allows 300, and two processes with a pool each for the
    # payments and DBOS's system tables share them; half the concurrency each.
    pool_size = concurrency // 2 + 4
    resources.pool = psycopg_pool.ConnectionPool(
        libpq_url, kwargs=_connect_kwargs(), min_size=2, max_size=pool_size, open=False
    )
    resources.pool.open(wait=True)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    resources.http = httpx.Client(base_url=sandbox_url, timeout=10.0, limits=limits)
    DBOS(config=config(libpq_url, executor_id=executor_id, pool_size=pool_size))
    try:
        DBOS.launch()
        DBOS.register_queue(
            QUEUE, worker_concurrency=concurrency, polling_interval_sec=POLLING_SECONDS
        )
        print("dbos worker ready", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        DBOS.destroy(workflow_completion_timeout_sec=0)
        resources.http.close()
        resources.pool.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A DBOS worker for the bench's second peer.")
    parser.add_argument("--database-url", required=True, help="a libpq URL")
    parser.add_argument("--sandbox-url", required=True)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--executor-id", default="dbos0")
    args = parser.parse_args(argv)
    run_worker(args.database_url, args.sandbox_url, args.concurrency, args.executor_id)


if __name__ == "__main__":
    main()
