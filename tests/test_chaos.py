"""The fault harness inside `make test`: a short run must be clean, and a
deliberately broken build must be caught."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import BACKENDS, Databases
from tests.support import INTENTLEDGER

pytestmark = pytest.mark.skipif(
    "postgresql" not in BACKENDS, reason="chaos runs on PostgreSQL (INTENTLEDGER_TEST_BACKENDS)"
)


def chaos(database_url: str, *args: str) -> tuple[int, dict[str, object], str]:
    done = subprocess.run(
        [*INTENTLEDGER, "chaos", "--database-url", database_url, *args],
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return done.returncode, report, done.stderr[-3000:]


def test_short_chaos_run_is_clean(databases: Databases) -> None:
    restart = os.environ.get("INTENTLEDGER_TEST_POSTGRES_RESTART")
    assert restart, "scripts/with-postgres sets INTENTLEDGER_TEST_POSTGRES_RESTART"
    code, report, log = chaos(
        databases.create("postgresql"),
        # Enough load to last well past five kills: 300 payments drained in
        # about three seconds once intake and dispatch were batched.
        "--operations",
        "1500",
        "--kill-every",
        "1",
        "--restart-db-cmd",
        restart,
        "--timeout",
        "180",
        "--seed",
        "7",
    )
    assert code == 0, (report, log)
    assert report["operations"] >= 1500
    assert report["kills"] >= 5  # type: ignore[operator]
    assert report["db_restarts"] == 1
    assert report["violations"] == 0


def test_chaos_catches_a_blind_retry_bug(databases: Databases) -> None:
    code, report, log = chaos(
        databases.create("postgresql"),
        "--operations",
        "120",
        "--kill-every",
        "3",
        "--timeout",
        "90",
        "--seed",
        "3",
        "--break-for-tests",
        "blind-retry",
    )
    assert code == 1, (report, log)
    assert report["duplicates"] > 0  # type: ignore[operator]
    assert report["violations"] > 0  # type: ignore[operator]
