"""`intentledger migrate`: bring a database's schema up to date with Alembic."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from intentledger.store.database import Pooler, require_utf8

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(database_url: str, pooler: Pooler = "none") -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["pooler"] = pooler  # read by migrations/env.py
    return config


def upgrade(database_url: str, revision: str = "head", *, pooler: Pooler = "none") -> None:
    require_utf8(database_url)
    command.upgrade(alembic_config(database_url, pooler), revision)
