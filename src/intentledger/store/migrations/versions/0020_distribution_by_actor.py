"""every table of an actor's rows carries the actor, in its keys: ready to be
distributed by actor (store/distribution.py, docs/scaling.md)

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06

- `actor` is added to the tables that lacked it and filled from the row's
  operation (observation, delivery, event), then made NOT NULL;
- every primary key and unique key of a table distributed by actor takes it
  (on SQLite a serial id stays the whole key: it is the rowid only so);
- every foreign key between such tables refers by (key, actor); on SQLite,
  where a serial id stays the whole primary key, decisions and
  webhook_deliveries get a unique index on (id, actor) for the foreign keys
  that refer to them;
- provider_events' key takes event_id, the column it is distributed by.

Before anything changes, a row whose parent is missing (so it has no actor to
take) stops the migration with its table and count (`refuse_orphans`).
Every existing row is then rewritten once (the fill: on PostgreSQL an
`UPDATE ... FROM` join per table), in this one transaction: like 0014 it runs
with the writers stopped (docs/operations.md gives the time it takes). On
SQLite the tables are rebuilt (batch mode) with foreign keys off, as SQLite
requires for rebuilding a table others refer to, and `PRAGMA
foreign_key_check` runs before the upgrade's one commit (migrations/env.py):
a row left naming a missing row makes the whole upgrade fail, the database
still at the revision it was at. `observation_details` is partitioned on
PostgreSQL: a column, NOT NULL and a primary key set on it reach every
partition.

Intake's writer (migration 0019's function, PostgreSQL) writes the submit row
and the first transition with their operation's actor, which each row it is
given already carries: same signature, same plan, two more columns.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

from intentledger.store.migrate import MigrationRefused

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

ACTOR = sa.String(255)

# table -> (the table its actor comes from, that table's key, the column naming
# it), in an order where a source is filled first.
FILLED = {
    "decisions": ("operations", "operation_id", "operation_id"),
    "attempts": ("operations", "operation_id", "operation_id"),
    "observations": ("operations", "operation_id", "operation_id"),
    "transitions": ("operations", "operation_id", "operation_id"),
    "outbox": ("operations", "operation_id", "operation_id"),
    "observation_details": ("observations", "id", "observation_id"),
    "webhook_deliveries": ("merchant_events", "event_id", "event_id"),
    "webhook_attempts": ("webhook_deliveries", "id", "delivery_id"),
}

# table -> its primary key before and after.
KEYS = {
    "operations": (["operation_id"], ["operation_id", "actor"]),
    "mandates": (["mandate_id"], ["mandate_id", "actor"]),
    "cards": (["card_id"], ["card_id", "actor"]),
    "merchant_events": (["event_id"], ["event_id", "actor"]),
    "webhook_endpoints": (["endpoint_id"], ["endpoint_id", "actor"]),
    "observation_details": (
        ["observation_id", "retention_bucket"],
        ["observation_id", "retention_bucket", "actor"],
    ),
}
# Serial ids: (id, actor) on PostgreSQL; on SQLite the rowid, alone.
SERIAL_KEYS = {
    "decisions": (["id"], ["id", "actor"]),
    "attempts": (["id"], ["id", "actor"]),
    "observations": (["id"], ["id", "actor"]),
    "transitions": (["id"], ["id", "actor"]),
    "outbox": (["id"], ["id", "actor"]),
    "webhook_deliveries": (["id"], ["id", "actor"]),
    "webhook_attempts": (["id"], ["id", "actor"]),
    "provider_events": (["id"], ["id", "event_id"]),
}

# (table, name, columns, referred table, referred columns) before and after.
OPERATION_KEYS = [
    (table, f"fk_{table}_operation_id_operations", "operations", "operation_id")
    for table in ("decisions", "attempts", "observations", "transitions", "outbox")
]
FOREIGN_KEYS_BEFORE = [
    *[(t, name, [col], ref, [col]) for t, name, ref, col in OPERATION_KEYS],
    ("attempts", "fk_attempts_decision_id_decisions", ["decision_id"], "decisions", ["id"]),
    ("outbox", "fk_outbox_decision_id_decisions", ["decision_id"], "decisions", ["id"]),
    (
        "webhook_deliveries",
        "fk_webhook_deliveries_event_id_merchant_events",
        ["event_id"],
        "merchant_events",
        ["event_id"],
    ),
    (
        "webhook_deliveries",
        "fk_webhook_deliveries_endpoint_id_webhook_endpoints",
        ["endpoint_id"],
        "webhook_endpoints",
        ["endpoint_id"],
    ),
    (
        "webhook_attempts",
        "fk_webhook_attempts_delivery_id_webhook_deliveries",
        ["delivery_id"],
        "webhook_deliveries",
        ["id"],
    ),
]
FOREIGN_KEYS_AFTER = [
    *[(t, name, [col, "actor"], ref, [col, "actor"]) for t, name, ref, col in OPERATION_KEYS],
    (
        "attempts",
        "fk_attempts_decision_id_decisions",
        ["decision_id", "actor"],
        "decisions",
        ["id", "actor"],
    ),
    (
        "outbox",
        "fk_outbox_decision_id_decisions",
        ["decision_id", "actor"],
        "decisions",
        ["id", "actor"],
    ),
    (
        "webhook_attempts",
        "fk_webhook_attempts_delivery_id_webhook_deliveries",
        ["delivery_id", "actor"],
        "webhook_deliveries",
        ["id", "actor"],
    ),
    (
        "webhook_deliveries",
        "fk_webhook_deliveries_event_id_merchant_events",
        ["event_id", "actor"],
        "merchant_events",
        ["event_id", "actor"],
    ),
    (
        "webhook_deliveries",
        "fk_webhook_deliveries_endpoint_id_webhook_endpoints",
        ["endpoint_id", "actor"],
        "webhook_endpoints",
        ["endpoint_id", "actor"],
    ),
]
# SQLite only: what a foreign key by (id, actor) refers to where the id alone
# is the primary key (tables.py); on PostgreSQL the primary key is (id, actor).
ID_ACTOR_UNIQUE_ON_SQLITE = {
    "decisions": "uq_decisions_id_actor",
    "webhook_deliveries": "uq_webhook_deliveries_id_actor",
}
# table -> (name, columns) of its unique key before and after.
UNIQUE_KEYS = {
    "attempts": (
        ("uq_attempts_operation_id_number", ["operation_id", "number"]),
        ("uq_attempts_operation_id_number_actor", ["operation_id", "number", "actor"]),
    ),
}


def _migration_0019() -> ModuleType:
    """Migration 0019, whose function this one changes (and a downgrade brings back)."""
    path = Path(__file__).with_name("0019_one_intake_writer.py")
    spec = importlib.util.spec_from_file_location("_intentledger_migration_0019", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def writer_with_actor() -> str:
    """0019's function, writing each new row's actor."""
    function: str = _migration_0019().FUNCTION
    for old, new in (
        (
            "INSERT INTO outbox (operation_id, kind, due_at, lease_owner, deliveries, created_at)\n"
            "        SELECT n.operation_id, 'submit',",
            "INSERT INTO outbox\n"
            "            (operation_id, actor, kind, due_at, lease_owner, deliveries, created_at)\n"
            "        SELECT n.operation_id, n.actor, 'submit',",
        ),
        (
            "INSERT INTO transitions\n"
            "            (operation_id, at, from_state, to_state, next_action, reason, source)\n"
            "        SELECT\n"
            "            n.operation_id, given_now,",
            "INSERT INTO transitions\n"
            "            (operation_id, actor, at, from_state, to_state, next_action, reason,\n"
            "            source)\n"
            "        SELECT\n"
            "            n.operation_id, n.actor, given_now,",
        ),
    ):
        assert function.count(old) == 1, old
        function = function.replace(old, new)
    return function


def upgrade() -> None:
    refuse_orphans()
    postgresql = op.get_bind().dialect.name == "postgresql"
    for table in FILLED:
        op.add_column(table, sa.Column("actor", ACTOR, nullable=True))
    for table, (source, key, column) in FILLED.items():
        if postgresql:
            # A join (one hash join per table), not a subquery per row.
            op.execute(
                f"UPDATE {table} AS t SET actor = s.actor FROM {source} AS s "
                f"WHERE s.{key} = t.{column}"
            )
        else:
            # SQLite has UPDATE ... FROM since 3.33 only; its tables are
            # rebuilt below anyway.
            op.execute(
                f"UPDATE {table} AS t SET actor = "
                f"(SELECT s.actor FROM {source} AS s WHERE s.{key} = t.{column})"
            )
    _rekey(
        sets_not_null=True,
        keys={t: after for t, (_, after) in {**KEYS, **SERIAL_KEYS}.items()},
        foreign_before=FOREIGN_KEYS_BEFORE,
        foreign_after=FOREIGN_KEYS_AFTER,
        unique={t: pair for t, pair in UNIQUE_KEYS.items()},
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(writer_with_actor())


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_migration_0019().FUNCTION)
    _rekey(
        sets_not_null=False,
        keys={t: before for t, (before, _) in {**KEYS, **SERIAL_KEYS}.items()},
        foreign_before=FOREIGN_KEYS_AFTER,
        foreign_after=FOREIGN_KEYS_BEFORE,
        unique={t: (after, before) for t, (before, after) in UNIQUE_KEYS.items()},
    )
    for table in reversed(FILLED):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("actor")


def refuse_orphans() -> None:
    """A row whose parent is missing has no actor to take: say which, before
    anything is changed, rather than fail on the NOT NULL it would break."""
    found = []
    for table, (source, key, column) in FILLED.items():
        orphans = (
            op.get_bind()
            .exec_driver_sql(
                f"SELECT count(*) FROM {table} AS t WHERE NOT EXISTS "
                f"(SELECT 1 FROM {source} AS s WHERE s.{key} = t.{column})"
            )
            .scalar_one()
        )
        if orphans:
            found.append(f"{orphans} {table} rows whose {column} names no {source} row")
    if found:
        raise MigrationRefused(
            "migration 0020 takes each row's actor from the row it belongs to, and "
            + "; ".join(found)
            + ": nothing was changed (restore those rows, or delete them, then migrate)"
        )


def _rekey(
    *,
    sets_not_null: bool,
    keys: dict[str, list[str]],
    foreign_before: list[tuple[str, str, list[str], str, list[str]]],
    foreign_after: list[tuple[str, str, list[str], str, list[str]]],
    unique: dict[str, tuple[tuple[str, list[str]], tuple[str, list[str]]]],
) -> None:
    """Foreign keys off, keys changed, foreign keys on again: a key a foreign
    key refers to cannot change under it."""
    if op.get_bind().dialect.name == "postgresql":
        for table, name, *_ in foreign_before:
            op.drop_constraint(name, table, type_="foreignkey")
        if sets_not_null:
            for table in FILLED:
                op.alter_column(table, "actor", existing_type=ACTOR, nullable=False)
        for table, columns in keys.items():
            op.drop_constraint(f"pk_{table}", table, type_="primary")
            op.create_primary_key(f"pk_{table}", table, columns)
        for table, ((old, _), (new, columns)) in unique.items():
            op.drop_constraint(old, table, type_="unique")
            op.create_unique_constraint(new, table, columns)
        for table, name, columns, referred, referred_columns in foreign_after:
            op.create_foreign_key(name, table, referred, columns, referred_columns)
        return
    # SQLite: each table rebuilt once, with all of its changes (batch mode).
    tables = dict.fromkeys(
        [*keys, *FILLED, *(t for t, *_ in foreign_before), *(t for t, *_ in foreign_after)]
    )
    for table in tables:
        with op.batch_alter_table(table, schema=None) as batch_op:
            for owner, name, *_ in foreign_before:
                if owner == table:
                    batch_op.drop_constraint(name, type_="foreignkey")
            if not sets_not_null and table in ID_ACTOR_UNIQUE_ON_SQLITE:
                batch_op.drop_index(ID_ACTOR_UNIQUE_ON_SQLITE[table])
            if sets_not_null and table in FILLED:
                batch_op.alter_column("actor", existing_type=ACTOR, nullable=False)
            if sets_not_null and table in ID_ACTOR_UNIQUE_ON_SQLITE:
                batch_op.create_index(
                    ID_ACTOR_UNIQUE_ON_SQLITE[table], ["id", "actor"], unique=True
                )
            if table in keys and table not in SERIAL_KEYS:
                batch_op.drop_constraint(f"pk_{table}", type_="primary")
                batch_op.create_primary_key(f"pk_{table}", keys[table])
            if table in unique:
                (old, _), (new, columns) = unique[table]
                batch_op.drop_constraint(old, type_="unique")
                batch_op.create_unique_constraint(new, columns)
            for owner, name, columns, referred, referred_columns in foreign_after:
                if owner == table:
                    batch_op.create_foreign_key(name, referred, columns, referred_columns)
