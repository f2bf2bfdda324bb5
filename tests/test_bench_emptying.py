"""The bench empties the ledger between phases without leaving counters that make
autovacuum analyze the empty tables (bench/emptying.py): an ANALYZE of an empty
`operations` once gave its foreign-key checks sequential scans for a whole phase."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from intentledger.store.database import libpq_url
from intentledger_tools.bench import workloads
from intentledger_tools.bench.emptying import empty_tables
from tests.conftest import BACKENDS, Databases

pytestmark = pytest.mark.skipif(
    "postgresql" not in BACKENDS,
    reason="statistics counters are PostgreSQL's (INTENTLEDGER_TEST_BACKENDS)",
)

TABLES = ["plain", "parted_early", "parted_late"]


def changes_since_analyze(url: str) -> dict[str, tuple[int, int]]:
    """(changes since the last ANALYZE, live rows) per table, as autovacuum reads them."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, n_mod_since_analyze, n_live_tup FROM pg_stat_user_tables"
            " WHERE relname = ANY(%s)",
            [TABLES],
        ).fetchall()
    return {name: (changes, live) for name, changes, live in rows}


def filled(url: str) -> None:
    """A plain table and a partitioned one, 200 rows in each table, counted."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute("CREATE TABLE plain (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE parted (id int, at int) PARTITION BY RANGE (at)")
        conn.execute("CREATE TABLE parted_early PARTITION OF parted FOR VALUES FROM (0) TO (100)")
        conn.execute("CREATE TABLE parted_late PARTITION OF parted FOR VALUES FROM (100) TO (200)")
        conn.execute("INSERT INTO plain SELECT generate_series(1, 200)")
        conn.execute("INSERT INTO parted SELECT g, g % 200 FROM generate_series(1, 400) g")
    # A session's counts reach the shared statistics when it ends, a moment later.
    deadline = time.monotonic() + 15
    while changes_since_analyze(url) != {t: (200, 200) for t in TABLES}:
        assert time.monotonic() < deadline, changes_since_analyze(url)
        time.sleep(0.1)


def test_emptied_tables_have_no_changes_for_autovacuum_to_analyze(
    databases: Databases,
) -> None:
    url = databases.create("postgresql")
    filled(url)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        assert empty_tables(conn, ["plain", "parted"]) is True
        counted = conn.execute(
            "SELECT (SELECT count(*) FROM plain) + (SELECT count(*) FROM parted)"
        ).fetchone()
        assert counted == (0,)
    # Without the reset, the 200 rows inserted before the truncate would still
    # count as changes since the last ANALYZE, and autovacuum would analyze.
    assert changes_since_analyze(url) == {t: (0, 0) for t in TABLES}


def test_a_refused_reset_still_empties_the_tables(databases: Databases) -> None:
    url = databases.create("postgresql")
    filled(url)
    role = f"bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        for table in ("plain", "parted"):
            conn.execute(
                sql.SQL("ALTER TABLE {} OWNER TO {}").format(*map(sql.Identifier, (table, role)))
            )
    try:
        as_role: dict[str, Any] = {"user": role}
        with psycopg.connect(libpq_url(url), autocommit=True, **as_role) as conn:
            assert empty_tables(conn, ["plain", "parted"]) is False
            counted = conn.execute(
                "SELECT (SELECT count(*) FROM plain) + (SELECT count(*) FROM parted)"
            ).fetchone()
            assert counted == (0,)
    finally:
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            for table in ("plain", "parted"):
                conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_seed_is_analyzed_by_its_own_transaction(databases: Databases) -> None:
    """What a seed writes carries statistics from its commit on (workloads.analyze):
    no worker plans a statement on an emptied table's figures while autovacuum has
    yet to look, which cost the server three times its CPU per payment for a
    drain's first minute."""
    url = databases.create("postgresql")
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute("CREATE TABLE plain (id int PRIMARY KEY, state text NOT NULL)")
        conn.commit()
        conn.execute(
            "INSERT INTO plain SELECT g, CASE WHEN g % 100 = 0 THEN 'due' ELSE 'done' END"
            " FROM generate_series(1, 5000) g"
        )
        workloads.analyze(conn, ["plain"])
        conn.commit()
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        assert conn.execute(
            "SELECT reltuples FROM pg_class WHERE relname = 'plain'"
        ).fetchone() == (5000.0,)
        frequencies = conn.execute(
            "SELECT most_common_vals::text FROM pg_stats WHERE tablename = 'plain'"
            " AND attname = 'state'"
        ).fetchone()
        assert frequencies is not None and "due" in frequencies[0]
