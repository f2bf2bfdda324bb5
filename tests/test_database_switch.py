"""A node that stops taking writes, as an old primary does when it comes back
as a standby after a failover (issue 38): the pool is dropped, the API
answers 503 `database-unavailable` with Retry-After (never 500), and once a
writable node is there again the same connections' engine writes.

The test server stands in for the node: its database is made read-only
(`default_transaction_read_only`) and its connections are cut, so the
service's next connections are read-only sessions, as a standby's are."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from intentledger.ports import free_port
from intentledger.store.database import create_ledger_engine, create_sync_engine, libpq_url
from intentledger.web.problems import database_unavailable
from tests.conftest import BACKENDS, Databases
from tests.support import Process
from tests.test_intake_http import PAYMENT, create_key

pytestmark = pytest.mark.skipif(
    "postgresql" not in BACKENDS, reason="INTENTLEDGER_TEST_BACKENDS excludes PostgreSQL"
)


def _admin(database_url: str, *statements: str) -> None:
    """Run `statements` on the server as the test's superuser, from outside
    the service, in the `postgres` database."""
    admin = make_url(database_url).set(database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def _read_only(database_url: str, on: bool) -> None:
    """Make the database's new sessions read-only (or writable again), and cut
    every session it has, so that pooled connections are replaced."""
    name = make_url(database_url).database
    setting = (
        f'ALTER DATABASE "{name}" SET default_transaction_read_only = on'
        if on
        else f'ALTER DATABASE "{name}" RESET default_transaction_read_only'
    )
    cut = (
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
    )
    _admin(database_url, setting, cut)


@pytest.fixture
def switched_database(databases: Databases) -> Iterator[str]:
    url = databases.create("postgresql")
    yield url
    _read_only(url, on=False)


def _write(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS switch_probe (n integer)"))
        conn.execute(text("INSERT INTO switch_probe VALUES (1)"))


def test_a_refused_write_on_a_read_only_node_drops_the_pool(switched_database: str) -> None:
    engine = create_sync_engine(switched_database)
    try:
        _write(engine)
        # A pooled connection that now lands on a read-only session: the
        # first write is refused, counted as a lost connection...
        with engine.connect() as conn:
            conn.execute(text("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"))
            conn.commit()
        with pytest.raises(DBAPIError) as refused:
            _write(engine)
        assert getattr(refused.value.orig, "sqlstate", None) == "25006"
        assert refused.value.connection_invalidated
        assert database_unavailable(refused.value)
        # ...and the pool was dropped: the next write is on a new connection.
        _write(engine)
    finally:
        engine.dispose()


def test_a_server_shutting_a_session_down_is_a_lost_connection(switched_database: str) -> None:
    """57P01 (the session ended by the server, as a demoted primary's are)."""
    engine = create_sync_engine(switched_database)
    try:
        with engine.connect() as conn:
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            conn.commit()
            _admin(switched_database, f"SELECT pg_terminate_backend({pid})")
            with pytest.raises(DBAPIError) as ended:
                conn.execute(text("SELECT 1"))
        assert ended.value.connection_invalidated
        assert database_unavailable(ended.value)
        _write(engine)
    finally:
        engine.dispose()


def test_the_async_engine_drops_its_pool_on_a_read_only_node(switched_database: str) -> None:
    async def scenario() -> None:
        engine = create_ledger_engine(switched_database, pool_size=2)
        try:
            async with engine.begin() as conn:
                await conn.execute(text("CREATE TABLE switch_probe (n integer)"))
            _read_only(switched_database, on=True)
            with pytest.raises(DBAPIError) as refused:
                async with engine.begin() as conn:
                    await conn.execute(text("INSERT INTO switch_probe VALUES (1)"))
            assert refused.value.connection_invalidated, refused.value
            _read_only(switched_database, on=False)
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO switch_probe VALUES (1)"))
        finally:
            await engine.dispose()

    asyncio.run(scenario())


def test_the_api_answers_503_while_its_node_takes_no_writes(
    switched_database: str, tmp_path: Path
) -> None:
    token = create_key(switched_database, "rita")
    port = free_port()
    api = Process(
        ["serve", "--no-workers", "--port", str(port), "--database-url", switched_database],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    statuses: Counter[int] = Counter()

    def pay(http: httpx.Client, key: str) -> httpx.Response:
        response = http.post(
            "/v1/payments",
            json=PAYMENT,
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
        )
        statuses[response.status_code] += 1
        return response

    try:
        api.wait_healthy(url + "/healthz")
        with httpx.Client(base_url=url, timeout=10) as http:
            assert pay(http, "before").status_code in (200, 202)
            _read_only(switched_database, on=True)
            for n in range(5):
                refused = pay(http, f"during-{n}")
                assert refused.status_code == 503, (refused.status_code, refused.text)
                assert refused.headers["content-type"].startswith("application/problem+json")
                assert refused.json()["type"].endswith("/database-unavailable")
                assert refused.headers["retry-after"] == "1"
            _read_only(switched_database, on=False)
            # The same key as a refused one: made once the node takes writes.
            deadline = time.monotonic() + 30
            while (answer := pay(http, "during-0")).status_code == 503:
                assert time.monotonic() < deadline, "writes never resumed"
                time.sleep(0.2)
            assert answer.status_code in (200, 202), answer.text
    finally:
        api.stop()
    assert statuses[500] == 0, (statuses, api.output()[-3000:])


def test_authentication_without_a_database_is_a_503_not_the_servers_500(
    switched_database: str, tmp_path: Path
) -> None:
    """A key not yet in the process's cache is looked up in the database before
    any route runs, on intake's own path and at the edge: with no node to ask,
    that is the routes' 503 too, and the server logs no traceback for it."""
    token = create_key(switched_database, "rita")
    port = free_port()
    api = Process(
        ["serve", "--no-workers", "--port", str(port), "--database-url", switched_database],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://127.0.0.1:{port}"
    name = make_url(switched_database).database
    try:
        api.wait_healthy(url + "/healthz")
        _admin(
            switched_database,
            f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false',
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()",
        )
        headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": "no-node"}
        with httpx.Client(base_url=url, timeout=10) as http:
            answers = [
                http.post("/v1/payments", json=PAYMENT, headers=headers),
                http.get("/v1/operations/op_none", headers=headers),
            ]
        for answer in answers:
            assert answer.status_code == 503, (answer.status_code, answer.text)
            assert answer.headers["content-type"].startswith("application/problem+json")
            assert answer.json()["type"].endswith("/database-unavailable")
            assert answer.headers["retry-after"] == "1"
    finally:
        _admin(switched_database, f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        api.stop()
    assert "Traceback" not in api.output(), api.output()[-3000:]
