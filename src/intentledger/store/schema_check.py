"""Is the database's schema at the migrations' head? Refuse to serve if not."""

from __future__ import annotations

from pathlib import Path

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from intentledger.store.database import (
    Pooler,
    create_sync_engine,
    dialect_of,
    parse_url,
    require_utf8,
)
from intentledger.store.migrate import alembic_config


class SchemaNotCurrent(RuntimeError):
    pass


def require_current_schema(database_url: str, pooler: Pooler = "none") -> None:
    """Refuse a database that is missing, not UTF-8, or not at the migrations' head.
    A missing SQLite file is not created by asking (connecting would create it)."""
    path = parse_url(database_url).database
    on_disk = dialect_of(database_url) == "sqlite" and path not in (None, "", ":memory:")
    if on_disk and not Path(str(path)).exists():
        raise SchemaNotCurrent(f"there is no database at {path}: run `intentledger migrate` first")
    require_utf8(database_url)
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    engine = create_sync_engine(database_url, pooler=pooler)
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
