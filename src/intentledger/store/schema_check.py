"""Is the database's schema at the migrations' head? Refuse to serve if not."""

from __future__ import annotations

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from intentledger.store.database import create_sync_engine, require_utf8
from intentledger.store.migrate import alembic_config


class SchemaNotCurrent(RuntimeError):
    pass


def require_current_schema(database_url: str) -> None:
    require_utf8(database_url)
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    engine = create_sync_engine(database_url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    if current != head:
        raise SchemaNotCurrent(
            f"the database schema is at {current or 'nothing'}, not {head}: "
            "run `intentledger migrate` first"
        )
