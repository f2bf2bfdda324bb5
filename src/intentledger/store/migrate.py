"""`intentledger migrate`: bring a database's schema up to date with Alembic,
and on PostgreSQL the provider answers' partitions with it, as wide as the
record retention calls for (store/partitions.py, domain/widths.py)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy.exc import DBAPIError

from intentledger.store.database import Pooler, create_sync_engine, dialect_of, require_utf8
from intentledger.store.partitions import busy, ensure_partitions

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"


class MigrationRefused(RuntimeError):
    """The data is not what a migration can carry over; nothing was changed."""


def alembic_config(database_url: str, pooler: Pooler = "none") -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["pooler"] = pooler  # read by migrations/env.py
    return config


def upgrade(
    database_url: str,
    revision: str = "head",
    retention: timedelta | None = None,
    *,
    pooler: Pooler = "none",
) -> Migrated:
    """Migrate to `revision`; on PostgreSQL, make the answers' partitions ahead
    for `retention` (the record retention; months when None)."""
    require_utf8(database_url)
    before = current_revision(database_url, pooler)
    command.upgrade(alembic_config(database_url, pooler), revision)
    if dialect_of(database_url) == "postgresql":
        _ensure_partitions(database_url, retention, pooler)
    return Migrated(before, current_revision(database_url, pooler))


class Migrated(NamedTuple):
    """The schema's revision before and after `upgrade` (None: no schema yet)."""

    before: str | None
    after: str | None


def current_revision(database_url: str, pooler: Pooler = "none") -> str | None:
    """The revision the database is at, as Alembic recorded it; None if it has none."""
    engine = create_sync_engine(database_url, pooler=pooler)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _ensure_partitions(database_url: str, retention: timedelta | None, pooler: Pooler) -> None:
    engine = create_sync_engine(database_url, pooler=pooler)
    try:
        with engine.begin() as conn:
            ensure_partitions(conn, datetime.now(UTC), retention)
    except DBAPIError as exc:
        if not busy(exc):
            raise
        # The default partition takes every answer meanwhile, and each
        # worker's reap pass tries again.
        log.warning("partitions of observation details not made: locks busy")
    finally:
        engine.dispose()
