"""Fixtures: a fresh, migrated database per test on SQLite and on PostgreSQL.

PostgreSQL is not optional. `make test` starts a throwaway server and sets
INTENTLEDGER_TEST_POSTGRES_URL; without it the run stops with an error rather
than quietly testing one database. INTENTLEDGER_TEST_BACKENDS=sqlite is an
explicit, visible opt-out for a quick local loop.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.ports import free_port
from intentledger.store.database import create_ledger_engine
from intentledger.store.direct import DirectConnections, direct_connections_for
from intentledger.store.migrate import upgrade
from intentledger_tools.bench.pgbouncer import PgBouncer, running_pgbouncer
from tests.support import Process

BACKENDS = [
    b for b in os.environ.get("INTENTLEDGER_TEST_BACKENDS", "sqlite,postgresql").split(",") if b
]
PG_ENV = "INTENTLEDGER_TEST_POSTGRES_URL"
pytest_plugins = ["tests.served"]


def pytest_configure(config: pytest.Config) -> None:
    if "postgresql" in BACKENDS and not os.environ.get(PG_ENV):
        raise pytest.UsageError(
            f"{PG_ENV} is not set, so the PostgreSQL half of the suite cannot run. "
            "Run `make test` (it starts a throwaway server), or set "
            "INTENTLEDGER_TEST_BACKENDS=sqlite to run the SQLite half on purpose."
        )


def pytest_report_header(config: pytest.Config) -> str:
    return f"intentledger backends: {', '.join(BACKENDS)}"


def _with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _pg_admin(sql: str) -> None:
    with psycopg.connect(os.environ[PG_ENV], autocommit=True) as conn:
        conn.execute(sql)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def pg_template() -> Iterator[str]:
    name = "il_template_" + secrets.token_hex(4)
    _pg_admin(f"CREATE DATABASE {name}")
    upgrade(_with_database(os.environ[PG_ENV], name))
    yield name
    _pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class Databases:
    """Makes fresh migrated databases by copying a template, and drops them."""

    def __init__(self, sqlite_template: Path, pg_template: str | None, workdir: Path) -> None:
        self.sqlite_template = sqlite_template
        self.pg_template = pg_template
        self.workdir = workdir
        self.pg_names: list[str] = []

    def create(self, backend: str) -> str:
        if backend == "sqlite":
            path = self.workdir / f"ledger-{secrets.token_hex(4)}.db"
            shutil.copy(self.sqlite_template, path)
            return f"sqlite:///{path}"
        assert self.pg_template is not None
        name = "il_test_" + secrets.token_hex(6)
        _pg_admin(f"CREATE DATABASE {name} TEMPLATE {self.pg_template}")
        self.pg_names.append(name)
        return _with_database(os.environ[PG_ENV], name)

    def drop_all(self) -> None:
        for name in self.pg_names:
            _pg_admin(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def databases(
    request: pytest.FixtureRequest, sqlite_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Databases]:
    pg = request.getfixturevalue("pg_template") if "postgresql" in BACKENDS else None
    factory = Databases(sqlite_template, pg, tmp_path_factory.mktemp("databases"))
    yield factory
    factory.drop_all()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(backend: str, databases: Databases) -> str:
    """A fresh database at the migrations' head."""
    return databases.create(backend)


# The direct connections made for each engine's workers (`direct_for`), closed
# with the engine by the fixtures that made it.
_DIRECT: dict[AsyncEngine, list[DirectConnections]] = {}


def direct_for(engine: AsyncEngine) -> DirectConnections | None:
    """The batched first attempts' own connections for a worker on `engine`, as
    `intentledger worker` gives it (none on SQLite)."""
    direct = direct_connections_for(
        engine.url.render_as_string(hide_password=False), engine.dialect
    )
    if direct is not None:
        _DIRECT.setdefault(engine, []).append(direct)
    return direct


async def dispose(engine: AsyncEngine) -> None:
    """Close `engine` and the direct connections made for it."""
    for direct in _DIRECT.pop(engine, []):
        await direct.close()
    await engine.dispose()


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_ledger_engine(database_url)
    yield eng
    await dispose(eng)


@pytest.fixture
async def engine_on_one_backend(databases: Databases) -> AsyncIterator[AsyncEngine]:
    """A fresh database's engine on PostgreSQL when the run has it, else on
    SQLite: for a slow check of what does not depend on the database (an
    adapter under the kit's chaos run), which both databases would only repeat."""
    eng = create_ledger_engine(
        databases.create("postgresql" if "postgresql" in BACKENDS else BACKENDS[0])
    )
    yield eng
    await dispose(eng)


@pytest.fixture(scope="session")
def pgbouncer() -> Iterator[PgBouncer]:
    """Debian's PgBouncer in transaction mode in front of the test server, with
    fewer server connections than the processes that go through it open."""
    if "postgresql" not in BACKENDS:
        pytest.skip("PgBouncer stands in front of PostgreSQL (INTENTLEDGER_TEST_BACKENDS)")
    with running_pgbouncer(os.environ[PG_ENV], pool_size=6) as bouncer:
        yield bouncer


@pytest.fixture
def sandbox(tmp_path: Path) -> Iterator[str]:
    """A standalone sandbox provider process; yields its base URL."""
    port = free_port()
    proc = Process(
        ["sandbox", "--port", str(port), "--sandbox-database", str(tmp_path / "sandbox.db")],
        {
            "INTENTLEDGER_SANDBOX_KEY_RETENTION": os.environ.get(
                "INTENTLEDGER_SANDBOX_KEY_RETENTION", "24h"
            )
        },
        tmp_path / "sandbox.log",
    )
    url = f"http://127.0.0.1:{port}/_sandbox"
    try:
        proc.wait_healthy(url + "/healthz")
        yield url
    finally:
        proc.stop()
