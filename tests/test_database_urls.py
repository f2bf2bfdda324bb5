"""A PostgreSQL URL naming several hosts, as libpq spells it:
`postgresql://user@h1:p1,h2:p2/db?target_session_attrs=read-write`. SQLAlchemy
cannot parse that form, so store/database.py reads it into SQLAlchemy's own
spelling (one `host=` parameter per host) for the engines and back into
libpq's for psycopg's own connections; libpq then tries each host in turn.
Every entry point (`migrate`, `serve`, `worker`, `reap`, the operator
commands) takes it."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy.engine import make_url

from intentledger.ports import free_port
from intentledger.store.database import (
    UnsupportedDatabase,
    async_url,
    dialect_of,
    hosts_of,
    libpq_url,
    lost_connection,
    parse_url,
    sync_url,
)
from tests.conftest import BACKENDS, Databases
from tests.served import serve
from tests.test_cli import run
from tests.test_intake_http import create_key

TWO_HOSTS = (
    "postgresql://ledger:p%40ss%2Fw@db1:5432,db2:5433/ledger?target_session_attrs=read-write"
)


def test_the_libpq_form_names_the_same_hosts_as_sqlalchemys() -> None:
    parsed = parse_url(TWO_HOSTS)
    assert dialect_of(TWO_HOSTS) == "postgresql"
    assert hosts_of(TWO_HOSTS) == ("db1:5432", "db2:5433")
    assert (parsed.username, parsed.password, parsed.database) == ("ledger", "p@ss/w", "ledger")
    assert parsed.query["target_session_attrs"] == "read-write"
    spelled = "postgresql://ledger:p%40ss%2Fw@/ledger?host=db1:5432&host=db2:5433&target_session_attrs=read-write"
    assert hosts_of(spelled) == hosts_of(TWO_HOSTS)
    for url in (async_url(TWO_HOSTS), sync_url(TWO_HOSTS)):
        assert make_url(url).query["host"] == ("db1:5432", "db2:5433")
        assert make_url(url).password == "p@ss/w"


def test_psycopg_is_given_the_hosts_in_libpqs_own_form() -> None:
    assert libpq_url(TWO_HOSTS) == TWO_HOSTS
    assert libpq_url("postgresql+psycopg://u@/db?host=a:1&host=b:2&connect_timeout=3") == (
        "postgresql://u@a:1,b:2/db?connect_timeout=3"
    )
    assert libpq_url("postgresql://a,b/db") == "postgresql://a,b/db"
    assert libpq_url("postgresql://u@a:1/db") == "postgresql://u@a:1/db"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql://u@a:1,,b:2/db", "an empty host"),
        ("postgresql://u@a:1,b:2/db?host=c:3", "not both"),
        # SQLAlchemy would cut it at its colons and drop the node unsaid.
        ("postgresql://u@[::1]:5432,b:2/db", r"'\[::1\]:5432' is not a host name"),
        ("postgresql://u@a:1,%2Frun%2Fpostgresql/db", "is not a host name"),
        ("postgresql://u@a:1,b:port/db", "'b:port' is not a host name"),
        ("postgresql://u@a:port/db", "cannot be read"),
        ("mysql://u@a/db", "unsupported database URL"),
    ],
)
def test_a_url_naming_its_hosts_wrongly_is_refused_without_its_password(
    url: str, says: str
) -> None:
    with pytest.raises(UnsupportedDatabase, match=says) as refused:
        dialect_of(url.replace("u@", "u:secret@"))
    assert "secret" not in str(refused.value)


@pytest.fixture
def postgres_url(databases: Databases) -> str:
    """A fresh migrated database on the test server."""
    if "postgresql" not in BACKENDS:
        pytest.skip("the PostgreSQL half is off (INTENTLEDGER_TEST_BACKENDS)")
    return databases.create("postgresql")


def behind_a_dead_host(url: str) -> str:
    """`url` with a host first in line that refuses every connection (a port
    nobody listens on), as a failed primary would, and read-write asked."""
    parsed = make_url(url)
    dead = f"127.0.0.1:{free_port()}"
    user = parsed.username or ""
    return (
        f"postgresql://{user}@{dead},{parsed.host}:{parsed.port}/{parsed.database}"
        "?target_session_attrs=read-write&connect_timeout=5"
    )


def test_every_entry_point_connects_through_the_host_that_answers(
    postgres_url: str, tmp_path: Path
) -> None:
    url = behind_a_dead_host(postgres_url)
    migrated = run("migrate", "--database-url", url)
    assert migrated.returncode == 0, migrated.stderr
    proc, base = serve(url, tmp_path, "24h")
    try:
        proc.wait_healthy(base + "/healthz")
        auth = {"Authorization": f"Bearer {create_key(postgres_url, 'dora')}"}
        paid = httpx.post(
            f"{base}/v1/payments",
            json={"amount": 990, "currency": "EUR", "payment_method": "pm_ok"},
            headers={**auth, "Idempotency-Key": "multi-host-1"},
        )
        assert paid.status_code == 202, paid.text
        op_id = paid.json()["id"]
        for _ in range(200):
            state = httpx.get(f"{base}/v1/operations/{op_id}", headers=auth).json()["state"]
            if state == "OUTCOME_KNOWN":
                break
            time.sleep(0.1)
        assert state == "OUTCOME_KNOWN"
    finally:
        proc.stop()
    listed = run("ops", "list", "--database-url", url)
    assert listed.returncode == 0 and op_id[:12] in listed.stdout, listed.stderr
    reaped = run("reap", "--database-url", url)
    assert reaped.returncode == 0, reaped.stderr


@pytest.mark.parametrize(
    ("sqlstate", "wrapper", "lost"),
    [
        ("25006", sqlalchemy.exc.InternalError, True),  # a node now a standby
        ("57P01", sqlalchemy.exc.OperationalError, True),  # shut down by the server
        ("57P03", sqlalchemy.exc.OperationalError, True),  # not yet accepting connections
        ("08006", sqlalchemy.exc.OperationalError, True),  # the connection failed
        ("40P01", sqlalchemy.exc.OperationalError, False),  # a deadlock: ours to look at
        ("57014", sqlalchemy.exc.OperationalError, False),  # a statement timeout
        ("23505", sqlalchemy.exc.IntegrityError, False),  # a unique key
        ("22P02", sqlalchemy.exc.DataError, False),  # bad input that got this far
    ],
)
def test_only_a_lost_connection_is_called_one(
    sqlstate: str, wrapper: type[sqlalchemy.exc.DBAPIError], lost: bool
) -> None:
    original = psycopg.errors.lookup(sqlstate)("what the server said")
    assert lost_connection(wrapper("SELECT 1", {}, original)) is lost
