"""The ledger behind a connection pooler in transaction mode (PgBouncer).

The racing workers (test_processes.py) and the short chaos run (test_chaos.py)
go through PgBouncer; here, why INTENTLEDGER_DATABASE_POOLER must be set.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
from pydantic import ValidationError
from sqlalchemy import text

from intentledger.settings import Settings
from intentledger.store.database import Pooler, UnsupportedDatabase, create_sync_engine
from intentledger_tools.bench.pgbouncer import PgBouncer, running_pgbouncer
from tests.conftest import BACKENDS, PG_ENV, Databases


@pytest.fixture
def two_server_connections() -> Iterator[PgBouncer]:
    """PgBouncer with two server connections for three clients: a client's next
    transaction lands on whichever is free, often not the one it used last."""
    if "postgresql" not in BACKENDS:
        pytest.skip("PgBouncer stands in front of PostgreSQL (INTENTLEDGER_TEST_BACKENDS)")
    with running_pgbouncer(os.environ[PG_ENV], pool_size=2) as bouncer:
        yield bouncer


def _shuffled_answers(url: str, pooler: Pooler) -> tuple[int, int]:
    """Three clients, each asking its own question (`SELECT <its number>`), 400
    times in a seeded order; half the time another client holds a transaction
    open meanwhile, so the asker gets the other server connection. Returns
    (answers that were another client's, errors)."""
    rng = random.Random(1)
    engines = [create_sync_engine(url, pooler=pooler) for _ in range(3)]
    wrong = errors = 0
    try:
        conns = [engine.connect() for engine in engines]
        for i in range(400):
            asker = rng.randrange(3)
            holder = conns[(asker + 1) % 3]
            holding = rng.random() < 0.5
            if holding:
                try:
                    holder.execute(text("SELECT 0"))
                except Exception:  # what goes wrong is what we count
                    holder.rollback()
                    holding = False
            try:
                question = text(f"SELECT {asker + 10} AS v, CAST(:x AS int) AS w")
                answer = conns[asker].execute(question, {"x": i}).scalar_one()
                wrong += answer != asker + 10
                conns[asker].commit()
            except Exception:
                errors += 1
                conns[asker].rollback()
            if holding:
                holder.commit()
        for conn in conns:
            conn.close()
    finally:
        for engine in engines:
            engine.dispose()
    return wrong, errors


def test_behind_pgbouncer_psycopg_defaults_return_other_clients_rows_and_the_pooler_mode_does_not(
    databases: Databases, two_server_connections: PgBouncer
) -> None:
    url = two_server_connections.url_for(databases.create("postgresql"))
    # psycopg's own default prepares a statement after its fifth use, on
    # whichever server connection the transaction had: another client's
    # statement of the same name answers, silently, with its own rows.
    wrong, errors = _shuffled_answers(url, "none")
    assert wrong > 0, (wrong, errors)
    assert _shuffled_answers(url, "pgbouncer") == (0, 0)


def test_a_pooler_needs_postgresql() -> None:
    with pytest.raises(ValidationError, match="needs a PostgreSQL database"):
        Settings(database_url="sqlite:///x.db", database_pooler="pgbouncer")
    with pytest.raises(ValidationError):
        Settings(database_url="postgresql://db/x", database_pooler="pgpool")
    with pytest.raises(UnsupportedDatabase, match="needs a postgresql"):
        create_sync_engine("sqlite:///x.db", pooler="pgbouncer")
