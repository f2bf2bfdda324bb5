"""Migrations on both databases, and settings from the environment and flags."""

from __future__ import annotations

import subprocess
from datetime import timedelta

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from intentledger.providers.http import call_deadline
from intentledger.settings import Settings
from intentledger.store.database import create_sync_engine
from intentledger.store.migrate import alembic_config, upgrade
from intentledger.store.partitions import is_partition_name
from intentledger.store.tables import declared_on, metadata
from tests.conftest import Databases
from tests.support import INTENTLEDGER


def test_migrate_builds_exactly_the_declared_schema(
    backend: str, databases: Databases, tmp_path: object
) -> None:
    url = databases.create(backend)
    engine = create_sync_engine(url)
    with engine.begin() as conn:  # start from nothing
        for table in reversed(metadata.sorted_tables):
            conn.execute(text(f"DROP TABLE {table.name}"))
        conn.execute(text("DROP TABLE alembic_version"))
    for _ in range(2):  # and migrating twice is harmless
        done = subprocess.run(
            [*INTENTLEDGER, "migrate", "--database-url", url], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    with engine.connect() as conn:
        # The answers' partitions (PostgreSQL) are retention's, not the schema's.
        context = MigrationContext.configure(
            conn,
            opts={
                "include_name": lambda name, kind, _parents: (
                    not (kind == "table" and is_partition_name(name))
                ),
                # What tables.py declares for the other database only.
                "include_object": declared_on(conn.dialect.name),
            },
        )
        assert compare_metadata(context, metadata) == []
    engine.dispose()


def test_settings_read_durations_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTENTLEDGER_SUBMIT_TIMEOUT", "500ms")
    monkeypatch.setenv("INTENTLEDGER_LEASE", "5m")
    monkeypatch.setenv("INTENTLEDGER_SANDBOX_KEY_RETENTION", "24h")
    settings = Settings()
    assert settings.submit_timeout == timedelta(milliseconds=500)
    assert settings.lease == timedelta(minutes=5)
    assert settings.sandbox_key_retention == timedelta(hours=24)
    assert settings.recheck_backoff == timedelta(seconds=30)  # docs/design.md#settings default
    assert Settings(lease="30s").lease == timedelta(seconds=30)  # a flag beats the environment


def test_a_bad_setting_is_a_clear_error(tmp_path: object) -> None:
    done = subprocess.run(
        [*INTENTLEDGER, "worker", "--lease", "five minutes", "--database-url", "sqlite:///x.db"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "lease" in done.stderr and "five minutes" in done.stderr


def test_the_sweeper_and_the_lease_must_outlast_every_provider_call() -> None:
    with pytest.raises(ValueError, match="stale_submitting must exceed"):
        Settings(submit_timeout="10s", stale_submitting="10s")
    with pytest.raises(ValueError, match="lease must exceed"):
        Settings(submit_timeout="10s", lease="5s")
    Settings(submit_timeout="1s", stale_submitting="2s", lease="2s")
    # A write in the request path is a provider call like any other.
    with pytest.raises(ValueError, match="stale_submitting must exceed"):
        Settings(submit_timeout="1s", sync_timeout="10s", stale_submitting="5s")
    assert Settings(submit_timeout="3s").request_path_timeout == timedelta(seconds=3)


def test_the_record_window_is_kept_short() -> None:
    """An answer waits at most the window for company; a long one would hold
    known outcomes in memory, where a crash makes them UNKNOWN."""
    assert Settings().record_window == timedelta(milliseconds=2)
    assert Settings(record_window="0s").record_window == timedelta(0)
    assert Settings(record_window="1s").record_window == timedelta(seconds=1)
    with pytest.raises(ValueError, match="record_window must be from 0 to 1s"):
        Settings(record_window="2s")
    # An answer waiting for company is still inside its call for the sweeper
    # and the lease: both must outlast the longest call and the window.
    longest_call = call_deadline(Settings().submit_timeout)
    between = f"{int((longest_call + timedelta(milliseconds=500)) / timedelta(milliseconds=1))}ms"
    assert Settings(record_window="0s", lease=between, stale_submitting=between)
    with pytest.raises(ValueError, match="lease must exceed the longest call"):
        Settings(record_window="1s", lease=between, stale_submitting="1h")
    with pytest.raises(ValueError, match="stale_submitting must exceed the longest call"):
        Settings(record_window="1s", stale_submitting=between)


def test_migrations_0015_and_0019_make_the_group_function_on_postgresql_and_take_it_away(
    backend: str, databases: Databases
) -> None:
    """0015 made intake's group function; 0019 replaced it by intake's one writer."""
    url = databases.create(backend)
    engine = create_sync_engine(url)
    first = "intentledger_accept_group(jsonb, timestamptz, text, text, text, text)"
    writer = (
        "intentledger_accept_group(jsonb, timestamptz, text, text, text, text, "
        "boolean, timestamptz, text, integer)"
    )

    def functions() -> set[str]:
        if backend != "postgresql":
            return set()
        with engine.connect() as conn:
            return {
                name
                for name in (first, writer)
                if conn.execute(
                    text("SELECT to_regprocedure(:name) IS NOT NULL"), {"name": name}
                ).scalar_one()
            }

    on_postgresql = backend == "postgresql"
    assert functions() == ({writer} if on_postgresql else set())
    command.downgrade(alembic_config(url), "0018")
    assert functions() == ({first} if on_postgresql else set())
    command.downgrade(alembic_config(url), "0014")
    assert functions() == set()
    upgrade(url)
    assert functions() == ({writer} if on_postgresql else set())
    engine.dispose()
