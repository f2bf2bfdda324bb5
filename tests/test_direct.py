"""The batched first attempts' own connections (store/direct.py), on PostgreSQL.

They carry the statements SQLAlchemy builds past its execution layer, so what
they must keep is what that layer gave: the same records from the same rows
(an instant aware and in UTC), the same exceptions, counts only at commit,
nothing written by a transaction that failed, and no answer lost to a
connection that died in the pool while the server restarted or a node stopped
taking writes. Each test uses a real server; a connection is killed with
`pg_terminate_backend`, and a node refusing writes is a transaction set read
only (every transaction on a standby is).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql
from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    insert,
    literal_column,
    select,
    text,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    InvalidRequestError,
    NoResultFound,
    OperationalError,
    StatementError,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.engine.settlement_queue import Sent, answered_now, record_together
from intentledger.store import libpq as libpq_module
from intentledger.store.batches import BatchLedger
from intentledger.store.database import create_ledger_engine, libpq_url, lost_connection
from intentledger.store.direct import DirectConnection, DirectConnections, _numbered
from intentledger.store.ids import among_ids
from intentledger.store.ledger import Ledger
from intentledger.store.records import OperationRecord, OutboxRecord
from intentledger.store.tables import mandates, observations, operations, outbox, transitions
from tests.conftest import BACKENDS, Databases, dispose
from tests.test_group_news import mandate, pay
from tests.test_group_record_plan import answer, ledger_of, presubmitted, story
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


async def gone(url: str, pids: set[int]) -> bool:
    """Whether none of `pids` is connected any more (a closed connection's
    server process leaves `pg_stat_activity` a moment after the client goes)."""
    for _ in range(50):
        if not pids & await backends_of(url):
            return True
        await asyncio.sleep(0.1)
    return False


async def terminate(url: str, pids: set[int]) -> None:
    async with await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True) as admin:
        for pid in pids:
            # Waits (up to 5 s) for the process to be gone, not only signalled.
            await admin.execute("SELECT pg_terminate_backend(%s, 5000)", [pid])


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
    engine, _ = pg
    scene = Scene(engine)
    operation_id = await pay(scene, "bea", "refused")
    committed: list[str] = []

    used: list[int] = []

    async def twice(conn: DirectConnection) -> None:
        used.append(conn.raw.info.backend_pid)
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
    assert await direct.run(_backend) == used[0]


async def _one(conn: DirectConnection) -> int:
    return int((await conn.execute(text("SELECT 1"))).scalar_one())


async def _backend(conn: DirectConnection) -> int:
    return int(conn.raw.info.backend_pid)


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


async def test_a_connection_found_lost_only_at_commit_is_not_run_again(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """A connection found lost only when its COMMIT is sent may have
    committed, as far as the worker can tell: the transaction is not run
    again, and its error says the connection was lost. (Here the server
    process is killed after the last statement, before the COMMIT.)"""
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
    assert await gone(url, idle)
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
    assert await gone(url, idle)
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

    assert await direct.run(_backend) != used[0]
    # The server was asked to cancel the statement, as psycopg asks: closing
    # the connection alone leaves a backend in pg_sleep (or waiting on a
    # lock) running until it ends.
    for _ in range(100):
        running = await direct.run(
            lambda conn: conn.execute(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = :pid"),
                {"pid": used[0]},
            )
        )
        if not running.scalar():
            break
        await asyncio.sleep(0.05)
    assert not running.scalar(), "the cancelled statement still runs on the server"


def _counted(name: str, labels: dict[str, str]) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_worker_whose_connections_died_settles_its_group_once(
    pg: tuple[AsyncEngine, str],
) -> None:
    """The pre-ping's promise, kept without it: a worker's connections die in
    its pool (a restart), and its next group record still settles every
    answer, once, with its counts applied once; its next pre-submit too."""
    engine, url = pg
    scene = Scene(engine)
    dispatcher = scene.worker.dispatcher
    assert dispatcher.direct is not None
    made = [await pay(scene, "cid", f"died-{n}") for n in range(3)]
    prepared = await presubmitted(scene, made)
    await terminate(url, await backends_of(url))
    settled_transitions = {"from_state": "SUBMITTING", "to_state": "OUTCOME_KNOWN"}
    before = (
        _counted("intentledger_transitions_total", settled_transitions),
        _counted("intentledger_group_commit_size_count", {"stage": "settle"}),
    )
    sent = [
        Sent(item, answer("succeeded", f"ch_{n}"), answered_now())
        for n, item in enumerate(prepared)
    ]
    assert await record_together(dispatcher, sent) == {id(item) for item in sent}
    assert (
        _counted("intentledger_transitions_total", settled_transitions) - before[0],
        _counted("intentledger_group_commit_size_count", {"stage": "settle"}) - before[1],
    ) == (3, 1)
    async with engine.connect() as conn:
        for operation_id in made:
            operation = await Ledger(conn).get_operation(operation_id)
            assert operation is not None and operation.outcome == "succeeded"
            kinds = (
                (
                    await conn.execute(
                        select(observations.c.kind).where(
                            observations.c.operation_id == operation_id
                        )
                    )
                )
                .scalars()
                .all()
            )
            assert kinds == ["submit_result"]
    more = [await pay(scene, "cid", f"after-{n}") for n in range(2)]
    await terminate(url, await backends_of(url))
    assert [item.row.operation_id for item in await presubmitted(scene, more)] == more


async def test_payments_under_a_mandate_end_on_its_own_connections_as_on_the_engine(
    pg: tuple[AsyncEngine, str],
) -> None:
    """A group under a mandate is planned under its locks and shifts the
    mandate's money: told on both transports, the same payments, observations,
    transitions and attempts, and the same reserved and spent."""
    engine, _ = pg
    endings = []
    for scene in (Scene(engine), Scene(engine, direct=False)):
        actor = f"held-{next(_keys)}"
        held = await mandate(scene, actor, f"{actor}-mandate")
        made = [await pay(scene, actor, f"{actor}-{n}", mandate_id=held) for n in range(3)]
        prepared = await presubmitted(scene, made)
        kinds = ["succeeded", "declined", "succeeded"]
        sent = [
            Sent(item, answer(kind, f"ch_{n}"), answered_now())
            for n, (item, kind) in enumerate(zip(prepared, kinds, strict=True))
        ]
        assert len(await record_together(scene.worker.dispatcher, sent)) == 3
        async with engine.connect() as conn:
            money = (
                await conn.execute(
                    select(mandates.c.reserved, mandates.c.spent, mandates.c.status).where(
                        mandates.c.mandate_id == held
                    )
                )
            ).one()
        payments = [await ledger_of(engine, operation_id, actor) for operation_id in made]
        for record, *_ in payments:
            assert record["mandate_id"] == held
            record["mandate_id"] = "<the mandate>"
        endings.append((tuple(money), payments))
    assert endings[0][0] == (0, 1000, "active")
    assert endings[0] == endings[1]


async def test_a_statement_built_per_call_binds_its_own_values(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """A mandate's shift is a statement built anew per call: compiled once for
    its shape, each binds its own literals, not the first one's."""
    engine, _ = pg
    scene = Scene(engine)
    first, second = [await mandate(scene, "dan", f"shape-{n}") for n in range(2)]

    async def shift(conn: DirectConnection) -> None:
        for mandate_id, amount in ((first, 100), (second, 250)):
            await conn.execute(
                mandates.update()
                .where(mandates.c.mandate_id == mandate_id)
                .values(reserved=mandates.c.reserved + amount)
            )

    await direct.run(shift)
    async with engine.connect() as conn:
        reserved = dict(
            (await conn.execute(select(mandates.c.mandate_id, mandates.c.reserved))).all()
        )
    assert (reserved[first], reserved[second]) == (100, 250)


async def test_what_the_engine_refuses_is_refused_alike_and_nothing_is_written(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    engine, _ = pg
    naive = datetime(2026, 1, 1)
    operation_id = await pay(Scene(engine), "eve", "refusals")

    async def naive_instant(conn: DirectConnection) -> None:
        await conn.execute(outbox.update().where(outbox.c.id == -1).values(due_at=naive))

    # A naive instant: refused by the column's type before anything is sent.
    with pytest.raises(StatementError, match="naive datetime"):
        await direct.run(naive_instant)

    async def none_found(conn: DirectConnection) -> None:
        (await conn.execute(select(outbox.c.id).where(outbox.c.id == -1))).one()

    with pytest.raises(NoResultFound):
        await direct.run(none_found)

    async def swallowed(conn: DirectConnection) -> None:
        await conn.execute(
            outbox.update()
            .where(outbox.c.operation_id == operation_id)
            .values(lease_owner="written")
        )
        with contextlib.suppress(DBAPIError):
            await conn.execute(text("SELECT 1 / 0"))

    # A statement failed and the work went on: not reported as committed.
    with pytest.raises(InvalidRequestError, match="not committed"):
        await direct.run(swallowed)

    async def returning_many(conn: DirectConnection) -> None:
        await conn.execute(
            outbox.update().where(outbox.c.id == -1).returning(outbox.c.id),
            [{"lease_owner": "a"}, {"lease_owner": "b"}],
        )

    with pytest.raises(ValueError, match="RETURNING"):
        await direct.run(returning_many)
    async with engine.connect() as conn:
        assert not (
            await conn.execute(select(outbox.c.id).where(outbox.c.lease_owner == "written"))
        ).all()
    assert await direct.run(_one) == 1


async def test_a_failing_count_at_commit_does_not_unmake_the_commit(
    direct: DirectConnections,
) -> None:
    counted: list[str] = []

    def broken() -> None:
        raise RuntimeError("a counter that fails")

    async def work(conn: DirectConnection) -> int:
        conn.after_commit(broken)
        conn.after_commit(lambda: counted.append("next"))
        return await _one(conn)

    assert await direct.run(work) == 1
    assert counted == ["next"]


def test_a_statements_placeholders_are_numbered_as_psycopg_numbers_them() -> None:
    """SQLAlchemy writes `%(name)s` and `%%`; libpq takes `$n`. A name used
    twice is one parameter, a doubled percent sign is one, and anything else
    after a percent sign is refused (SQLAlchemy writes nothing else)."""
    numbered, order = _numbered("SELECT %(a)s, %(b_1)s, %(a)s, 'ten %%' WHERE x = %(c)s")
    assert numbered == b"SELECT $1, $2, $1, 'ten %' WHERE x = $3"
    assert order == ("a", "b_1", "c")
    for refused in ("SELECT 5 % 3", "SELECT %()s", "SELECT %(a)b"):
        with pytest.raises(ValueError, match="lone %"):
            _numbered(refused)


async def _prepared_here(conn: DirectConnection) -> set[str]:
    return set(await _runs_by_name(conn))


async def _runs_by_name(conn: DirectConnection) -> dict[str, int]:
    """The statements prepared on this connection, and how often each ran (was planned)."""
    rows = await conn.execute(
        text(
            "SELECT name, generic_plans + custom_plans AS runs FROM pg_prepared_statements"
            " WHERE name LIKE '\\_%'"
        )
    )
    return {row.name: row.runs for row in rows}


async def test_statements_are_prepared_as_psycopg_prepares_them_and_outlive_a_rollback(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """A statement is prepared on a connection once it has run there five
    times, as psycopg prepares one, and runs by name after, whatever its
    transaction's end: psycopg prepares nothing of its own on these connections, so its
    rollback (which deallocates every statement once it has prepared one)
    never takes ours. An executemany, sent by psycopg's cursor, runs often
    enough for psycopg to have prepared it, had it been left to."""
    engine, _ = pg
    scene = Scene(engine)
    operation_id = await pay(scene, "bea", "prepared")

    async def failing(conn: DirectConnection) -> None:
        row = {
            "operation_id": operation_id,
            "actor": "bea",
            "from_state": "ACCEPTED",
            "to_state": "ACCEPTED",
            "next_action": "submit",
            "reason": "taken back",
            "source": "test",
            "at": scene.clock(),
        }
        for _ in range(6):
            await conn.execute(insert(transitions), [row, row])
        await conn.execute(text("SELECT 1 / 0"))

    for _ in range(5):
        assert await direct.run(_one) == 1
    assert await direct.run(_runs_by_name) == {}
    assert await direct.run(_one) == 1
    first = await direct.run(_runs_by_name)
    assert len(first) == 1 and all(name.startswith("_intentledger_") for name in first)
    with pytest.raises(DBAPIError, match="division by zero"):
        await direct.run(failing)
    assert await direct.run(_one) == 1
    after = await direct.run(_runs_by_name)
    assert not any(name.startswith("_pg3_") for name in after)
    # `_one` ran by name once more; nothing else of it was prepared.
    assert {name: after[name] - runs for name, runs in first.items()} == dict.fromkeys(first, 1)


async def test_a_prepared_statement_found_stale_runs_again_on_a_new_connection(
    pg: tuple[AsyncEngine, str], direct: DirectConnections
) -> None:
    """A migration that changes what a prepared statement returns (a column
    widened) makes the server refuse to run it (0A000), and one deallocated
    behind our back is gone (26000). Either way the transaction wrote
    nothing: it runs again on a new connection, and no connection that
    prepared statements before it is kept."""
    engine, _ = pg
    widened = Table(
        "widened_under_prepared",
        MetaData(),
        Column("id", BigInteger, primary_key=True),
        Column("name", String(10)),
    )
    async with engine.begin() as conn:
        await conn.run_sync(widened.metadata.create_all)
        await conn.execute(insert(widened), [{"id": 1, "name": "short"}])
    backends: list[int] = []

    async def read(conn: DirectConnection) -> list[tuple[Any, ...]]:
        backends.append(conn.raw.info.backend_pid)
        return [tuple(row) for row in await conn.execute(select(widened))]

    for _ in range(6):
        assert await direct.run(read) == [(1, "short")]
    async with engine.begin() as conn:
        await conn.execute(text("ALTER TABLE widened_under_prepared ALTER name TYPE varchar(20)"))
    backends.clear()
    assert await direct.run(read) == [(1, "short")]
    assert len(backends) == 2 and backends[0] != backends[1]

    for _ in range(6):
        assert await direct.run(_one) == 1

    async def deallocating(conn: DirectConnection) -> int:
        backends.append(conn.raw.info.backend_pid)
        await conn.execute(text("DEALLOCATE ALL"))
        return await _one(conn)

    backends.clear()
    assert await direct.run(deallocating) == 1
    assert len(backends) == 2 and backends[0] != backends[1]


async def test_behind_a_pooler_nothing_is_prepared(pg: tuple[AsyncEngine, str]) -> None:
    engine, url = pg
    pooled = DirectConnections(url, engine.dialect, pooler="pgbouncer")
    try:
        for _ in range(6):
            assert await pooled.run(_one) == 1
        assert await pooled.run(_prepared_here) == set()
    finally:
        await pooled.close()


async def test_values_of_one_statement_in_every_size_and_kind_come_back_as_sent(
    direct: DirectConnections,
) -> None:
    """One statement, prepared once per kind of its values' types: an integer
    psycopg sends as int2 or int8 by its size, a null, text that is
    not ASCII, a list, an instant each come back as sent."""
    statement = select(
        bindparam("number", type_=BigInteger()).label("number"),
        bindparam("word", type_=Text()).label("word"),
        bindparam("words", type_=postgresql.ARRAY(Text())).label("words"),
        bindparam("at", type_=DateTime(timezone=True)).label("at"),
    )
    at = datetime(2026, 12, 7, 23, 0, tzinfo=UTC)
    sent = [
        (1, "zoë", ["a", "ключ"], at),
        (2**40, None, [], at),
        (-(2**62), "x", ["'", '"', "%"], at + timedelta(microseconds=1)),
        (3, "again", ["b"], at),
    ]

    async def each(conn: DirectConnection) -> list[tuple[Any, ...]]:
        got = []
        for number, word, words, instant in sent:
            parameters = {"number": number, "word": word, "words": words, "at": instant}
            got.append(tuple((await conn.execute(statement, parameters)).one()))
        return got

    # Past psycopg's fifth use: each kind prepared, then run by name.
    for _ in range(7):
        assert await direct.run(each) == [tuple(row) for row in sent]


async def test_a_transactions_first_statement_failing_with_its_begin_leaves_nothing_open(
    direct: DirectConnections,
) -> None:
    """BEGIN, a statement's preparation and the statement go out in one
    pipeline: a statement that fails there is SQLAlchemy's exception, its
    transaction is rolled back and its connection serves again. A failed run
    does not count towards preparing it (psycopg counts only those that
    succeed); one that fails in the pipeline that prepares it leaves it
    prepared, and it runs by name after."""
    divide = select((literal_column("10") / bindparam("by", type_=BigInteger())).label("q"))
    used: list[int] = []

    async def divided(conn: DirectConnection, by: int) -> int:
        used.append(conn.raw.info.backend_pid)
        return int((await conn.execute(divide, {"by": by})).scalar_one())

    for _ in range(6):
        with pytest.raises(DBAPIError, match="division by zero"):
            await direct.run(lambda conn: divided(conn, 0))
    for _ in range(5):
        assert await direct.run(lambda conn: divided(conn, 5)) == 2
    assert await direct.run(_runs_by_name) == {}
    with pytest.raises(DBAPIError, match="division by zero"):
        await direct.run(lambda conn: divided(conn, 0))
    assert len(set(used)) == 1
    (name,) = await direct.run(_runs_by_name)
    before = (await direct.run(_runs_by_name))[name]
    assert await direct.run(lambda conn: divided(conn, 2)) == 5
    assert (await direct.run(_runs_by_name))[name] == before + 1


async def test_an_error_inside_a_pipeline_closes_its_connection_rather_than_wait(
    direct: DirectConnections, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error raised while a transaction's BEGIN and first statement are in
    libpq's pipeline leaves the connection in pipeline mode, which psycopg
    knows nothing of. The connection is closed, not rolled back (psycopg's
    ROLLBACK, a simple query, is refused there by this libpq; one that took
    it would wait for a synchronisation point), and the next transaction
    runs on a new one, in time."""
    first = await direct.run(_backend)

    async def broken(conn: psycopg.AsyncConnection[Any]) -> list[Any]:
        raise RuntimeError("the pipeline's reading failed")

    monkeypatch.setattr(libpq_module, "pipelined", broken)
    with pytest.raises(RuntimeError, match="reading failed"):
        await asyncio.wait_for(direct.run(_one), timeout=10)
    monkeypatch.undo()
    assert await asyncio.wait_for(direct.run(_backend), timeout=10) != first
    assert await direct.run(_one) == 1
