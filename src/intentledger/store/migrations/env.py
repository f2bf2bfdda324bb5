"""Alembic environment: one migration history for SQLite and PostgreSQL."""

from __future__ import annotations

from alembic import context

from intentledger.store.database import create_sync_engine
from intentledger.store.migrate import MigrationRefused
from intentledger.store.partitions import is_partition_name
from intentledger.store.tables import declared_on, metadata

config = context.config
url = config.get_main_option("sqlalchemy.url")
assert url, "intentledger.store.migrate sets sqlalchemy.url"

engine = create_sync_engine(url, pooler=config.attributes.get("pooler", "none"))
with engine.connect() as connection:
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        # A table others refer to can only be rebuilt (batch mode) with foreign
        # keys off, and SQLite ignores that setting inside a transaction: so it
        # is set before the migrations' transaction, on the driver's connection.
        # What they leave is checked before they commit (below).
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")  # type: ignore[union-attr]
    context.configure(
        connection=connection,
        target_metadata=metadata,
        render_as_batch=sqlite,
        # Alembic's SQLite default (False) commits each migration on its own,
        # so the check below would run after the fact, on a database already
        # at the new revision. SQLite's DDL is transactional: every migration
        # of one upgrade runs in the one transaction, and the check refuses
        # its commit, leaving the database at the revision it was at.
        transactional_ddl=True if sqlite else None,
        # The answers' partitions come and go with retention, not with
        # the declared schema (store/partitions.py).
        include_name=lambda name, kind, _parents: not (kind == "table" and is_partition_name(name)),
        include_object=declared_on(connection.dialect.name),
    )
    with context.begin_transaction():
        context.run_migrations()
        if sqlite:
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise MigrationRefused(
                    "not migrated, the database is as it was: rows refer to rows that do "
                    "not exist, which the migrated schema's foreign keys refuse: "
                    + "; ".join(
                        f"{table} (rowid {rowid}) -> {parent}"
                        for table, rowid, parent, _key in broken[:10]
                    )
                    + (f" (and {len(broken) - 10} more)" if len(broken) > 10 else "")
                )
engine.dispose()
