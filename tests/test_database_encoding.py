"""A PostgreSQL database that does not store UTF-8 is refused with one clear line."""

from __future__ import annotations

import os
import secrets
import subprocess

import pytest

from tests.conftest import BACKENDS, PG_ENV, _pg_admin, _with_database
from tests.support import INTENTLEDGER

pytestmark = pytest.mark.skipif(
    "postgresql" not in BACKENDS, reason="INTENTLEDGER_TEST_BACKENDS excludes PostgreSQL"
)


@pytest.mark.parametrize("command", [["migrate"], ["serve", "--no-workers", "--port", "1"]])
def test_a_sql_ascii_database_is_refused_at_migrate_and_start_up(command: list[str]) -> None:
    name = "il_ascii_" + secrets.token_hex(4)
    _pg_admin(
        f"CREATE DATABASE {name} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' "
        "TEMPLATE template0"
    )
    try:
        url = _with_database(os.environ[PG_ENV], name)
        done = subprocess.run(
            [*INTENTLEDGER, *command, "--database-url", url],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == 1, done
        lines = [line for line in done.stderr.splitlines() if "SQL_ASCII" in line]
        assert lines and "not UTF8" in lines[0] and "ENCODING 'UTF8'" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        _pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
