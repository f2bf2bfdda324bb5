"""The batched first attempts' own connections (store/direct.py), on PostgreSQL.

They carry the statements SQLAlchemy builds past its execution layer, so what
they must keep is what that layer gave: the same records from the same rows
(an instant aware and in UTC), the same exceptions, counts only at commit,
nothing written by a transaction that failed, and no answer lost to a
connection that died in the pool while the server restarted or a node stopped
taking writes. Each test uses a real server; a connection is killed with
`pg_terminate_backend`, a node refusing writes is a database set read-only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.settlement_queue import record_together
from intentledger.store.batches import BatchLedger
from intentledger.store.database import create_ledger_engine, libpq_url, lost_connection
from intentledger.store.direct import DirectConnection, DirectConnections
from intentledger.store.ids import among_ids
from intentledger.store.records import OperationRecord, OutboxRecord
from intentledger.store.tables import operations, outbox, transitions
from tests.conftest import BACKENDS, Databases, dispose
from tests.test_group_news import pay
from tests.test_group_record_plan import story
from tests.test_recovery_model import Scene

LEASE = timedelta(minutes=5)
_keys = itertools.count()


@pytest.fixture
async def pg(databases: Databases) -> AsyncIterator[tuple[AsyncEngine, str]]:
    if "postgresql" not in BACKENDS:
        pytest.skip("PostgreSQL is not in INTENTLEDGER_TEST_BACKENDS")
    url = databases.create("postgresql")
    # A server whose sessions speak another zone: every instant read back
    # must still come out in UTC, as the engine's type gives it.
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as admin:
        await admin.execute(
            sql.SQL("ALTER DATABASE {} SET timezone TO 'Pacific/Chatham'").format(
                sql.Identifier(admin.info.dbname)
            )
        )
    engine = create_ledger_engine(url)
    yield engine, url
    await dispose(engine)


@pytest.fixture
async def direct(pg: tuple[AsyncEngine, str]) -> AsyncIterator[DirectConnections]:
    engine, url = pg
    connections = DirectConnections(url, engine.dialect)
    yield connections
    await connections.close()


async def backends_of(url: str) -> set[int]:
    """The server processes connected to the database of `url`."""
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as admin:
        cursor = await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        )
        return {row[0] for row in await cursor.fetchall()}


async def terminate(url: str, pids: set[int]) -> None:
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as admin:
        for pid in pids:
            await admin.execute("SELECT pg_terminate_backend(%s)", [pid])


async def test_the_hot_path_reads_the_records_the_engine_reads(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """The claim, the locks and the leases read through the direct connections
    equal what the engine reads of the same rows: every column, and every
    instant aware and in UTC."""
    engine, _ = pg
    scene = Scene(engine)
    made = sorted([await pay(scene, "ada", f"read-{n}") for n in range(3)])
    now = scene.clock()

    async def claim(conn: Any) -> Any:
        return await BatchLedger(conn).claim_outbox_rows(now, LEASE, "reader", 10)

    claimed = await direct.run(claim)
    async with engine.connect() as conn:
        rows = await conn.execute(select(outbox).where(outbox.c.operation_id.in_(made)))
        by_engine = {row.id: OutboxRecord.of(row) for row in rows}
    assert {row.id: row for row in claimed} == by_engine

    async def locked(conn: Any) -> Any:
        ledger = BatchLedger(conn)
        return (
            await ledger.lock(made),
            await ledger.leases_held([row.id for row in claimed], "reader", now),
        )

    (through_direct, held_direct) = await direct.run(locked)
    async with engine.begin() as conn:
        through_engine, held_engine = await locked(conn)
    assert through_direct == through_engine
    assert held_direct == held_engine == {row.id for row in claimed}
    for record in [*through_direct.operations.values(), *claimed]:
        for name in record.__match_args__:
            value = getattr(record, name)
            if isinstance(value, datetime):
                assert value.tzinfo is UTC, (name, value)


async def test_a_statement_refused_raises_sqlalchemys_exception_and_writes_nothing(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    engine, url = pg
    scene = Scene(engine)
    operation_id = await pay(scene, "bea", "refused")
    committed: list[str] = []

    async def twice(conn: DirectConnection) -> None:
        conn.after_commit(lambda: committed.append("counted"))
        row = {
            "operation_id": operation_id,
            "actor": "bea",
            "from_state": "ACCEPTED",
            "to_state": "ACCEPTED",
            "next_action": "submit",
            "reason": "a row the rollback must take back",
            "source": "test",
            "at": scene.clock(),
        }
        await conn.execute(insert(transitions), [row])
        # An operation whose key is taken: the unique key refuses it.
        async with engine.connect() as read:
            record = OperationRecord.of(
                (
                    await read.execute(
                        select(operations).where(operations.c.operation_id == operation_id)
                    )
                ).one()
            )
        await conn.execute(insert(operations), [record.as_dict()])

    async with engine.connect() as conn:
        before = (await conn.execute(select(transitions.c.id))).scalars().all()
    with pytest.raises(IntegrityError) as refused:
        await direct.run(twice)
    assert not refused.value.connection_invalidated and not lost_connection(refused.value)
    assert committed == []
    async with engine.connect() as conn:
        assert (await conn.execute(select(transitions.c.id))).scalars().all() == before
    # The connection went back to the pool rolled back, and serves again.
    assert await direct.run(lambda conn: _one(conn)) == 1
    assert len(await backends_of(url)) >= 1


async def _one(conn: DirectConnection) -> int:
    return int((await conn.execute(text("SELECT 1"))).scalar_one())


async def test_counts_wait_for_the_commit(direct: DirectConnections) -> None:
    counted: list[str] = []

    async def counts(conn: DirectConnection) -> None:
        conn.after_commit(lambda: counted.append("committed"))
        await _one(conn)

    async def fails(conn: DirectConnection) -> None:
        conn.after_commit(lambda: counted.append("rolled back"))
        raise RuntimeError("the work failed")

    await direct.run(counts)
    with pytest.raises(RuntimeError):
        await direct.run(fails)
    assert counted == ["committed"]


async def test_a_connection_that_died_in_the_pool_costs_no_transaction(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """A server restart kills the pooled connections: the next transaction
    fails on one before its COMMIT, so nothing was written, and it runs again
    on a new connection and commits."""
    _, url = pg
    await direct.run(_one)
    await terminate(url, await backends_of(url))
    tries: list[int] = []

    async def work(conn: DirectConnection) -> int:
        tries.append(conn.raw.info.backend_pid)
        return await _one(conn)

    assert await direct.run(work) == 1
    assert len(tries) == 2 and tries[0] != tries[1]


async def test_a_connection_lost_at_commit_is_not_run_again(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """Lost when its COMMIT is sent, a transaction may have committed: it is
    not run again, and its error says the connection was lost."""
    _, url = pg
    runs: list[int] = []

    async def killed_before_commit(conn: DirectConnection) -> None:
        runs.append(1)
        await _one(conn)
        await terminate(url, {conn.raw.info.backend_pid})

    with pytest.raises(OperationalError) as lost:
        await direct.run(killed_before_commit)
    assert runs == [1]
    assert lost.value.connection_invalidated and lost_connection(lost.value)
    assert await direct.run(_one) == 1


async def test_a_node_that_stops_taking_writes_is_a_lost_connection(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """A write refused because the node is read-only (25006, an old primary
    come back as a standby) drops the idle connections and is tried once more;
    refused again, its error is a lost connection, as the engine reports it."""
    _, url = pg
    await direct.run(_one)
    idle = await backends_of(url)
    runs: list[int] = []

    async def write(conn: DirectConnection) -> None:
        runs.append(conn.raw.info.backend_pid)
        await conn.execute(text("SET TRANSACTION READ ONLY"))
        await conn.execute(outbox.update().where(outbox.c.id == -1).values(lease_owner="nobody"))

    # 25006 is psycopg's InternalError, as the engine raises it too.
    with pytest.raises(DBAPIError) as refused:
        await direct.run(write)
    assert len(runs) == 2 and runs[0] != runs[1]
    assert refused.value.connection_invalidated and lost_connection(refused.value)
    # The connections that were idle then are gone, not handed out again.
    assert not idle & await backends_of(url)
    assert await direct.run(_one) == 1


async def test_an_expanding_list_is_refused_with_a_clear_error(
    direct: DirectConnections,
) -> None:
    async def expanding(conn: DirectConnection) -> None:
        await conn.execute(
            select(outbox.c.id).where(among_ids(outbox.c.operation_id, is_postgres=False)),
            {"ids": ["a", "b"]},
        )

    with pytest.raises(ValueError, match="expanding"):
        await direct.run(expanding)


async def test_closing_closes_every_idle_connection(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    _, url = pg
    await direct.run(_one)
    idle = await backends_of(url)
    assert idle
    await direct.close()
    assert not idle & await backends_of(url)
    with pytest.raises(RuntimeError, match="closed"):
        await direct.run(_one)


async def test_a_group_record_ends_on_its_own_connections_as_on_the_engine(
    pg: tuple[AsyncEngine, str],
) -> None:
    """The same stories told by a worker on the direct connections and by one
    on the engine leave the ledger the same: every answer kind, and answers
    the reference path recorded first."""
    engine, _ = pg
    on_direct = Scene(engine)
    on_engine = Scene(engine, direct=False)
    assert on_direct.worker.dispatcher.direct is not None
    assert on_engine.worker.dispatcher.direct is None
    plans = [
        [("succeeded", None), ("declined", None), ("lost", None)],
        [("succeeded", "lost"), ("pending", None), ("not_executed", "succeeded")],
        [("succeeded", "pending"), ("declined", "lost")],
    ]
    for plan in plans:
        assert await story(on_direct, plan, record_together) == await story(
            on_engine, plan, record_together
        )


async def test_a_transaction_cancelled_mid_statement_leaves_no_connection_behind(
    direct: DirectConnections,
) -> None:
    """A worker stopping cancels what it runs: a connection cancelled in the
    middle of a statement may be in any state, so it is closed, not handed to
    the next transaction."""
    started = asyncio.Event()
    used: list[int] = []

    async def sleeps(conn: DirectConnection) -> None:
        used.append(conn.raw.info.backend_pid)
        started.set()
        await conn.execute(text("SELECT pg_sleep(30)"))

    task = asyncio.create_task(direct.run(sleeps))
    await started.wait()
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def backend(conn: DirectConnection) -> int:
        return conn.raw.info.backend_pid

    assert await direct.run(backend) != used[0]
