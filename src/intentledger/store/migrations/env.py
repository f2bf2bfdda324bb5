"""Alembic environment: one migration history for SQLite and PostgreSQL."""

from __future__ import annotations

from alembic import context

from intentledger.store.database import create_sync_engine
from intentledger.store.partitions import is_partition_name
from intentledger.store.tables import metadata

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
        # The answers' partitions come and go with retention, not with
        # the declared schema (store/partitions.py).
        include_name=lambda name, kind, _parents: not (kind == "table" and is_partition_name(name)),
    )
    with context.begin_transaction():
        context.run_migrations()
        if sqlite:
            broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"the migrations left rows their foreign keys refuse: {broken}")
engine.dispose()
