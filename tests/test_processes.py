"""Real worker processes: racing dispatchers, and a worker SIGKILLed mid-call."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.clock import system_clock
from intentledger.store.database import create_ledger_engine
from intentledger.store.tables import attempts, observations, operations
from intentledger_tools.bench.pgbouncer import PgBouncer
from tests.conftest import Databases
from tests.support import Process, wait_until
from tests.test_dispatch import accept

PAYMENTS = 500


def start_worker(
    database_url: str,
    sandbox: str,
    log: Path,
    *,
    lease: str = "5m",
    timeout: str = "10s",
    extra: list[str] | None = None,
) -> Process:
    return Process(
        [
            "worker",
            "--database-url",
            database_url,
            "--provider-url",
            sandbox,
            "--lease",
            lease,
            "--submit-timeout",
            timeout,
            "--concurrency",
            "8",
            *(extra or []),
        ],
        {},
        log,
    )


async def count_in_state(engine: AsyncEngine, state: str) -> int:
    async with engine.connect() as conn:
        query = select(func.count()).select_from(operations).where(operations.c.state == state)
        return int((await conn.execute(query)).scalar_one())


async def wait_for_state(engine: AsyncEngine, state: str, count: int, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while await count_in_state(engine, state) < count:
        assert asyncio.get_running_loop().time() < deadline, f"fewer than {count} reached {state}"
        await asyncio.sleep(0.2)


async def test_racing_workers_submit_every_payment_exactly_once(
    engine: AsyncEngine, database_url: str, backend: str, sandbox: str, tmp_path: Path
) -> None:
    await race_workers(
        engine, sandbox, tmp_path, [database_url] * (2 if backend == "sqlite" else 4)
    )


async def test_racing_workers_through_pgbouncer_in_transaction_mode_submit_once(
    databases: Databases, pgbouncer: PgBouncer, sandbox: str, tmp_path: Path
) -> None:
    """Four workers whose every transaction may land on another of PgBouncer's
    six server connections: without INTENTLEDGER_DATABASE_POOLER=pgbouncer
    their prepared statements collide (errors, or another query's rows)."""
    database_url = databases.create("postgresql")
    engine = create_ledger_engine(database_url)
    try:
        through = pgbouncer.url_for(database_url)
        logs = await race_workers(
            engine, sandbox, tmp_path, [through] * 4, ["--database-pooler", "pgbouncer"]
        )
    finally:
        await engine.dispose()
    for log in logs:
        assert "Traceback" not in log and "prepared statement" not in log, log[-3000:]


async def race_workers(
    engine: AsyncEngine,
    sandbox: str,
    tmp_path: Path,
    worker_urls: list[str],
    worker_args: list[str] | None = None,
) -> list[str]:
    """One worker per URL, every one running, then PAYMENTS accepted for them to
    race for: every payment must be submitted exactly once, and every worker
    must take part. Returns the workers' logs. (Accepted before the workers
    started, the payments were all settled at times by the first workers up,
    on a loaded machine, before the last one had begun: no race at all.)"""
    worker_count = len(worker_urls)
    workers = [
        start_worker(url, sandbox, tmp_path / f"worker-{n}.log", extra=worker_args or [])
        for n, url in enumerate(worker_urls)
    ]
    try:
        for worker in workers:
            await asyncio.to_thread(
                wait_until,
                lambda w=worker: "worker " in w.output() and " started" in w.output(),
                60,
                f"{worker.log.name} to start",
            )
        for start in range(0, PAYMENTS, 50):
            await asyncio.gather(
                *(
                    accept(engine, system_clock, "pm_ok", key=f"race-{i}")
                    for i in range(start, start + 50)
                )
            )
        await wait_for_state(engine, "OUTCOME_KNOWN", PAYMENTS, timeout=180)
    except AssertionError as exc:
        tails = "\n".join(f"--- {w.log.name}\n{w.output()[-1500:]}" for w in workers)
        raise AssertionError(f"{exc}; the workers' logs end:\n{tails}") from exc
    finally:
        for worker in workers:
            worker.stop()

    async with engine.connect() as conn:
        ids = {row.operation_id for row in await conn.execute(select(operations.c.operation_id))}
        attempt_rows = (
            await conn.execute(select(attempts.c.operation_id, attempts.c.source))
        ).all()
        outcomes = Counter(row.outcome for row in await conn.execute(select(operations.c.outcome)))
    assert outcomes == {"succeeded": PAYMENTS}
    assert Counter(row.operation_id for row in attempt_rows) == Counter(dict.fromkeys(ids, 1))
    # The provider's truth: one charge and one submit request per payment.
    charges = Counter(c["reference"] for c in httpx.get(f"{sandbox}/charges").json()["data"])
    submits = Counter(
        r["reference"]
        for r in httpx.get(f"{sandbox}/requests").json()["data"]
        if r["kind"] == "submit"
    )
    assert charges == Counter(dict.fromkeys(ids, 1))
    assert submits == Counter(dict.fromkeys(ids, 1))
    # Every worker took part: the race was real.
    assert len({row.source for row in attempt_rows}) == worker_count
    return [worker.output() for worker in workers]


async def test_worker_killed_after_submitting_commit_leaves_unknown_not_a_resend(
    engine: AsyncEngine, database_url: str, sandbox: str, tmp_path: Path
) -> None:
    # The sandbox withholds this answer and executes nothing on the first
    # attempt; any later attempt would execute, so a resend would show as a charge.
    op_id = await accept(engine, system_clock, "pm_timeout_before_execute", key="crash-1")
    first = start_worker(database_url, sandbox, tmp_path / "first.log", lease="3s", timeout="2s")
    try:
        wait_until(
            lambda: (
                len(httpx.get(f"{sandbox}/requests", params={"reference": op_id}).json()["data"])
                == 1
            ),
            30,
            "the first worker's provider call",
        )
        assert await count_in_state(engine, "SUBMITTING") == 1
        first.kill()
    finally:
        first.stop()

    second = start_worker(database_url, sandbox, tmp_path / "second.log", lease="3s", timeout="2s")
    try:
        await wait_for_state(engine, "UNKNOWN", 1, timeout=30)
        await asyncio.sleep(1.0)  # room for a wrongful second call to show up
    finally:
        second.stop()

    async with engine.connect() as conn:
        op = (
            await conn.execute(select(operations).where(operations.c.operation_id == op_id))
        ).one()
        kinds = [
            r.kind
            for r in await conn.execute(
                select(observations.c.kind).where(observations.c.operation_id == op_id)
            )
        ]
        attempt_count = (
            await conn.execute(
                select(func.count()).select_from(attempts).where(attempts.c.operation_id == op_id)
            )
        ).scalar_one()
    assert (op.state, op.next_action, op.outcome) == ("UNKNOWN", "reconcile", None)
    assert kinds == ["resumed_submitting"] and attempt_count == 1
    submits = [
        r
        for r in httpx.get(f"{sandbox}/requests", params={"reference": op_id}).json()["data"]
        if r["kind"] == "submit"
    ]
    assert len(submits) == 1
    assert len(httpx.get(f"{sandbox}/charges", params={"reference": op_id}).json()["data"]) <= 1
