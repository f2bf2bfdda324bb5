"""The ledger behind a connection pooler in transaction mode (PgBouncer).

The racing workers (test_processes.py) and the short chaos run (test_chaos.py)
go through PgBouncer; here, why INTENTLEDGER_DATABASE_POOLER must be set.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from intentledger.bench.pgbouncer import PgBouncer, running_pgbouncer
from intentledger.settings import Settings
from intentledger.store.database import Pooler, UnsupportedDatabase, create_sync_engine
from tests.conftest import BACKENDS, PG_ENV, Databases


@pytest.fixture
def one_server_connection() -> Iterator[PgBouncer]:
    """PgBouncer with a single server connection: every client's transactions
    share it, so what one client prepares there the other meets."""
    if "postgresql" not in BACKENDS:
        pytest.skip("PgBouncer stands in front of PostgreSQL (INTENTLEDGER_TEST_BACKENDS)")
    with running_pgbouncer(os.environ[PG_ENV], pool_size=1) as bouncer:
        yield bouncer


def _interleaved_answers(url: str, pooler: Pooler) -> tuple[list[int], list[str]]:
    """Two clients take turns, each asking its own question eight times (past
    psycopg's threshold of five, after which it prepares a statement)."""
    first, second = create_sync_engine(url, pooler=pooler), create_sync_engine(url, pooler=pooler)
    answers: list[int] = []
    errors: list[str] = []
    try:
        with first.connect() as a, second.connect() as b:
            for _ in range(8):
                for conn, value in ((a, 1), (b, 2)):
                    try:
                        answers.append(
                            conn.execute(text(f"SELECT {value} + 0 * :x"), {"x": 1}).scalar_one()
                        )
                        conn.commit()
                    except Exception as exc:  # what goes wrong is what we report
                        errors.append(type(exc).__name__)
                        conn.rollback()
    finally:
        first.dispose()
        second.dispose()
    return answers, errors


def test_prepared_statements_go_wrong_behind_pgbouncer_unless_the_pooler_is_set(
    databases: Databases, one_server_connection: PgBouncer
) -> None:
    url = one_server_connection.url_for(databases.create("postgresql"))

    answers, errors = _interleaved_answers(url, "none")
    # psycopg's own default: the second client meets the first one's
    # statement name on the shared server connection.
    assert errors or answers != [1, 2] * 8, (answers, errors)

    answers, errors = _interleaved_answers(url, "pgbouncer")
    assert (answers, errors) == ([1, 2] * 8, [])


def test_a_pooler_needs_postgresql() -> None:
    with pytest.raises(ValidationError, match="needs a PostgreSQL database"):
        Settings(database_url="sqlite:///x.db", database_pooler="pgbouncer")
    with pytest.raises(ValidationError):
        Settings(database_url="postgresql://db/x", database_pooler="pgpool")
    with pytest.raises(UnsupportedDatabase, match="needs a postgresql"):
        create_sync_engine("sqlite:///x.db", pooler="pgbouncer")
