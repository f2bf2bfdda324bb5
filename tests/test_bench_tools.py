"""The bench's pgbench runner: a run that stalls is stopped, and the server
sessions it leaves behind are ended, instead of hanging the bench (issue 18:
one 256-client baseline sat on the lock manager for 11 minutes)."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest

from intentledger.store.database import libpq_url
from intentledger_tools.bench.tools import (
    PgbenchTimedOut,
    end_pgbench_sessions,
    find_pgbench,
    run_pgbench,
)
from tests.conftest import BACKENDS, Databases

pytestmark = pytest.mark.skipif(
    "postgresql" not in BACKENDS,
    reason="pgbench runs on PostgreSQL (INTENTLEDGER_TEST_BACKENDS)",
)


def pgbench_sessions(url: str) -> int:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = 'pgbench' AND datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_stalled_run_is_stopped_and_its_sessions_ended(
    databases: Databases, tmp_path: Path
) -> None:
    url = databases.create("postgresql")
    script = tmp_path / "stall.pgbench"
    script.write_text("SELECT pg_sleep(120);\n")
    started = time.monotonic()
    with pytest.raises(PgbenchTimedOut, match="ran past 2 s"):
        run_pgbench(find_pgbench(), url, script, clients=2, threads=1, timeout=2)
    assert time.monotonic() - started < 60
    # Killing pgbench leaves its statements running on the server.
    assert pgbench_sessions(url) == 2
    end_pgbench_sessions(url)
    assert pgbench_sessions(url) == 0


def test_a_run_that_finishes_in_time_is_measured(databases: Databases, tmp_path: Path) -> None:
    url = databases.create("postgresql")
    script = tmp_path / "select.pgbench"
    script.write_text("SELECT 1;\n")
    result = run_pgbench(
        find_pgbench(), url, script, clients=2, threads=1, transactions_per_client=5, timeout=60
    )
    assert result.transactions == 10 and result.failed == 0 and result.tps > 0
    end_pgbench_sessions(url)  # nothing left to end: returns at once
