"""The schema is ready to be distributed by actor (store/distribution.py).

Read from a migrated database (so the migrations are held to it, not only
tables.py) and from tables.py's metadata: every table is declared; a table
distributed by actor has the actor in its columns, its primary key, every
unique key and every foreign key to another such table; a table distributed
by its own key has that column in its keys; a reference table refers to
reference tables only; and Citus can distribute them in the declared order.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from dataclasses import dataclass, field, replace

import pytest
from alembic import command
from sqlalchemy import ForeignKeyConstraint, UniqueConstraint, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from intentledger.store.database import create_sync_engine
from intentledger.store.distribution import (
    DISTRIBUTION_COLUMN,
    UNDECLARED_FOREIGN_KEYS,
    ByActor,
    OwnKey,
    Placement,
    Reference,
    citus_statements,
)
from intentledger.store.distribution import TABLES as DECLARED
from intentledger.store.migrate import (
    MigrationRefused,
    alembic_config,
    current_revision,
    upgrade,
)
from intentledger.store.partitions import is_partition_name
from intentledger.store.tables import metadata
from tests.conftest import Databases

ForeignKey = tuple[tuple[str, ...], str, tuple[str, ...]]


@dataclass
class Shape:
    """What distribution depends on, per table."""

    columns: dict[str, set[str]] = field(default_factory=dict)
    not_null: dict[str, set[str]] = field(default_factory=dict)
    primary: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unique: dict[str, list[tuple[str, ...]]] = field(default_factory=dict)
    foreign: dict[str, list[ForeignKey]] = field(default_factory=dict)


def declared_shape() -> Shape:
    shape = Shape()
    for name, table in metadata.tables.items():
        shape.columns[name] = {c.name for c in table.columns}
        shape.not_null[name] = {c.name for c in table.columns if not c.nullable}
        shape.primary[name] = tuple(c.name for c in table.primary_key.columns)
        shape.unique[name] = [
            tuple(c.name for c in constraint.columns)
            for constraint in table.constraints
            if isinstance(constraint, UniqueConstraint)
        ] + [tuple(c.name for c in index.columns) for index in table.indexes if index.unique]
        shape.foreign[name] = [
            (
                tuple(constraint.column_keys),
                constraint.referred_table.name,
                tuple(element.column.name for element in constraint.elements),
            )
            for constraint in table.constraints
            if isinstance(constraint, ForeignKeyConstraint)
        ]
    return shape


def live_shape(conn: Connection) -> Shape:
    inspector = inspect(conn)
    shape = Shape()
    for name in inspector.get_table_names():
        if name == "alembic_version" or is_partition_name(name):
            continue
        columns = inspector.get_columns(name)
        shape.columns[name] = {c["name"] for c in columns}
        shape.not_null[name] = {c["name"] for c in columns if not c["nullable"]}
        shape.primary[name] = tuple(inspector.get_pk_constraint(name)["constrained_columns"])
        shape.unique[name] = [
            tuple(u["column_names"]) for u in inspector.get_unique_constraints(name)
        ] + [
            tuple(c for c in i["column_names"] if c is not None)
            for i in inspector.get_indexes(name)
            if i["unique"]
        ]
        shape.foreign[name] = [
            (tuple(f["constrained_columns"]), f["referred_table"], tuple(f["referred_columns"]))
            for f in inspector.get_foreign_keys(name)
        ]
    return shape


# A column naming a row of another table, by its name.
NAMES_A_ROW_OF = {
    "operation_id": "operations",
    "parent_operation_id": "operations",
    "pending_operation_id": "operations",
    "mandate_id": "mandates",
    "card_id": "cards",
    "decision_id": "decisions",
    "observation_id": "observations",
    "event_id": "merchant_events",
    "endpoint_id": "webhook_endpoints",
    "delivery_id": "webhook_deliveries",
    "api_key_id": "api_keys",
}
# `*_id` columns naming no row of ours: the provider's id, or a row of one of several tables.
NAMES_NO_ROW = {
    ("cards", "provider_card_id"),
    ("idempotency_records", "resource_id"),
    ("merchant_events", "object_id"),
    ("provider_events", "object_id"),
}


def unreferenced(
    shape: Shape, declared: dict[str, Placement], undeclared: dict[tuple[str, str], str]
) -> list[str]:
    """Every column of a table distributed by actor that names a row of another
    such table has a foreign key, or is listed (with a reason) as having none;
    and every listed column exists and has none."""
    found = []
    for table in sorted(set(shape.columns) & set(declared)):
        with_key = {c for columns, _, _ in shape.foreign[table] for c in columns}
        for column in sorted(c for c in shape.columns[table] if c.endswith("_id")):
            if (table, column) in NAMES_NO_ROW:
                continue
            referred = NAMES_A_ROW_OF.get(column)
            if referred is None:
                found.append(f"{table}.{column}: names a row of which table? (NAMES_A_ROW_OF)")
                continue
            both_by_actor = isinstance(declared[table], ByActor) and isinstance(
                declared.get(referred), ByActor
            )
            own_key = referred == table and column in shape.primary[table]
            if own_key or not both_by_actor or column in with_key:
                continue
            if (table, column) not in undeclared:
                found.append(f"{table}.{column}: names a row of {referred} with no foreign key")
    for table, column in sorted(undeclared):
        if column not in shape.columns.get(table, set()):
            found.append(f"{table}.{column}: listed as undeclared, but no such column")
    return found


def problems(
    shape: Shape,
    declared: dict[str, Placement],
    serial_rowids: Shape | None = None,
    undeclared: dict[tuple[str, str], str] = UNDECLARED_FOREIGN_KEYS,
) -> list[str]:
    """What would keep `shape` from being distributed as `declared` says.
    `serial_rowids`: the declared shape, on SQLite, whose serial ids are the
    whole key (store/distribution.py)."""
    found = unreferenced(shape, declared, undeclared)
    undeclared = set(shape.columns) - set(declared)
    missing = set(declared) - set(shape.columns)
    found += [f"{t}: no placement declared (store/distribution.py)" for t in sorted(undeclared)]
    found += [f"{t}: declared but not in the schema" for t in sorted(missing)]

    def key_column(table: str) -> str | None:
        placement = declared.get(table)
        if isinstance(placement, ByActor):
            return DISTRIBUTION_COLUMN
        if isinstance(placement, OwnKey):
            return placement.column
        return None

    for table in sorted(set(shape.columns) & set(declared)):
        placement = declared[table]
        column = key_column(table)
        if column is not None:
            if column not in shape.not_null[table]:
                found.append(f"{table}: no NOT NULL {column}")
            primary = shape.primary[table]
            rowid = (
                serial_rowids is not None
                and primary == ("id",)
                and serial_rowids.primary.get(table) == ("id", column)
            )
            if column not in primary and not rowid:
                found.append(f"{table}: primary key {primary} lacks {column}")
            for unique in shape.unique[table]:
                if column not in unique:
                    found.append(f"{table}: unique key {unique} lacks {column}")
        for columns, referred, referred_columns in shape.foreign[table]:
            target = declared.get(referred)
            if isinstance(placement, Reference) and not isinstance(target, Reference):
                found.append(f"{table}: a reference table refers to {referred}")
            if isinstance(placement, ByActor) and isinstance(target, ByActor):
                pairs = set(zip(columns, referred_columns, strict=True))
                if (DISTRIBUTION_COLUMN, DISTRIBUTION_COLUMN) not in pairs:
                    found.append(f"{table}: foreign key {columns} to {referred} lacks the actor")
            if isinstance(placement, ByActor) and isinstance(target, OwnKey):
                found.append(f"{table}: refers to {referred}, distributed apart")
            if isinstance(placement, OwnKey) and not isinstance(target, Reference | None):
                found.append(f"{table}: refers to {referred}, distributed apart")
            if (table, columns[0]) in undeclared:
                found.append(f"{table}: foreign key {columns} declared as undeclared")
            order = list(declared)
            if referred in declared and order.index(referred) > order.index(table):
                found.append(f"{table}: distributed before {referred}, which it refers to")
    return found


def test_tables_py_declares_every_table_distributable() -> None:
    assert problems(declared_shape(), DECLARED) == []


def test_the_migrated_schema_is_distributable(backend: str, databases: Databases) -> None:
    engine = create_sync_engine(databases.create(backend))
    with engine.connect() as conn:
        live = live_shape(conn)
    engine.dispose()
    declared = declared_shape()
    rowids = declared if backend == "sqlite" else None
    assert problems(live, DECLARED, serial_rowids=rowids) == []
    # And the migrations built what tables.py declares, key for key.
    assert live.columns == declared.columns
    assert live.not_null == declared.not_null
    for table, primary in live.primary.items():
        if rowids is not None and primary == ("id",):
            assert declared.primary[table][0] == "id", table
        else:
            assert set(primary) == set(declared.primary[table]), table
    for table in live.foreign:
        assert sorted(live.foreign[table]) == sorted(declared.foreign[table]), table


def test_a_table_not_declared_or_not_keyed_by_actor_is_caught() -> None:
    shape = declared_shape()
    grown = replace(
        shape,
        columns={**shape.columns, "payouts": {"id", "operation_id"}},
        not_null={**shape.not_null, "payouts": {"id", "operation_id"}},
        primary={**shape.primary, "payouts": ("id",)},
        unique={**shape.unique, "payouts": []},
        foreign={
            **shape.foreign,
            "payouts": [(("operation_id",), "operations", ("operation_id",))],
        },
    )
    assert problems(grown, DECLARED) == ["payouts: no placement declared (store/distribution.py)"]
    declared = {**DECLARED, "payouts": ByActor("a payout belongs to one actor")}
    assert problems(grown, declared) == [
        "payouts: no NOT NULL actor",
        "payouts: primary key ('id',) lacks actor",
        "payouts: foreign key ('operation_id',) to operations lacks the actor",
    ]
    as_reference = {**DECLARED, "payouts": Reference("small")}
    assert problems(grown, as_reference) == ["payouts: a reference table refers to operations"]
    unique = replace(grown, unique={**grown.unique, "outbox": [("operation_id", "kind")]})
    assert "outbox: unique key ('operation_id', 'kind') lacks actor" in problems(unique, declared)


def test_a_row_named_with_no_foreign_key_and_a_stale_listing_are_caught() -> None:
    shape = declared_shape()
    without = replace(
        shape,
        foreign={
            **shape.foreign,
            "outbox": [f for f in shape.foreign["outbox"] if f[1] != "decisions"],
        },
    )
    assert problems(without, DECLARED) == [
        "outbox.decision_id: names a row of decisions with no foreign key"
    ]
    assert problems(without, DECLARED, undeclared={("outbox", "decision_id"): "why"}) == [
        "cards.pending_operation_id: names a row of operations with no foreign key",
        "observation_details.observation_id: names a row of observations with no foreign key",
        "operations.mandate_id: names a row of mandates with no foreign key",
        "operations.parent_operation_id: names a row of operations with no foreign key",
    ]
    stale = {**UNDECLARED_FOREIGN_KEYS, ("outbox", "decision"): "renamed since"}
    assert problems(shape, DECLARED, undeclared=stale) == [
        "outbox.decision: listed as undeclared, but no such column"
    ]
    grown = replace(shape, columns={**shape.columns, "outbox": {*shape.columns["outbox"], "x_id"}})
    assert problems(grown, DECLARED) == [
        "outbox.x_id: names a row of which table? (NAMES_A_ROW_OF)"
    ]


def test_citus_statements_distribute_every_table_in_order() -> None:
    statements = citus_statements()
    assert len(statements) == len(DECLARED) == len(metadata.tables)
    assert statements[:3] == [
        "SELECT create_reference_table('api_keys')",
        "SELECT create_reference_table('console_sessions')",
        "SELECT create_distributed_table('operations', 'actor')",
    ]
    assert (
        "SELECT create_distributed_table('outbox', 'actor', colocate_with => 'operations')"
        in statements
    )
    assert (
        "SELECT create_distributed_table('provider_events', 'event_id', colocate_with => 'none')"
        in statements
    )


OLD_ROWS = [
    "INSERT INTO operations (operation_id, idempotency_key, state, request_context, "
    "next_action, actor, route, kind, request_hash, provider, version, created_at, updated_at) "
    "VALUES ('op_1', 'k1', 'ACCEPTED', '{}', 'submit', 'shop-a', 'payments', 'payment', 'h', "
    "'sandbox', 1, :at, :at)",
    "INSERT INTO decisions (id, operation_id, at, rule, inputs, next_action, reason, source) "
    "VALUES (7, 'op_1', :at, 'r', '{}', 'submit', 'why', 's')",
    "INSERT INTO attempts (operation_id, number, provider_idempotency_key, submitted_at, "
    "relation, decision_id, source) VALUES ('op_1', 1, 'pk', :at, 'original', 7, 's')",
    "INSERT INTO observations (id, operation_id, at, kind, source) "
    "VALUES (9, 'op_1', :at, 'submit_result', 's')",
    "INSERT INTO observation_details (observation_id, retention_bucket, detail) "
    "VALUES (9, :at, '{}')",
    "INSERT INTO transitions (operation_id, at, to_state, next_action, reason, source) "
    "VALUES ('op_1', :at, 'ACCEPTED', 'submit', 'r', 's')",
    "INSERT INTO outbox (operation_id, kind, due_at, deliveries, decision_id, created_at) "
    "VALUES ('op_1', 'submit', :at, 0, 7, :at)",
    "INSERT INTO merchant_events (event_id, actor, type, object_id, payload, created_at) "
    "VALUES ('evt_1', 'shop-a', 'payment.accepted', 'op_1', '{}', :at)",
    "INSERT INTO webhook_endpoints (endpoint_id, actor, url, secret, created_at) "
    "VALUES ('we_1', 'shop-a', 'https://shop.example/hook', 's', :at)",
    "INSERT INTO webhook_deliveries (id, event_id, endpoint_id, status, due_at, attempts, "
    "created_at) VALUES (3, 'evt_1', 'we_1', 'pending', :at, 0, :at)",
    "INSERT INTO webhook_attempts (delivery_id, at, duration_ms, delivered) "
    "VALUES (3, :at, 5, false)",
]
FILLED = (
    "decisions",
    "attempts",
    "observations",
    "observation_details",
    "transitions",
    "outbox",
    "webhook_deliveries",
    "webhook_attempts",
)


@pytest.mark.parametrize("round_trip", ["upgrade", "and back"])
def test_migration_0020_fills_each_rows_actor_from_its_operation(
    backend: str, databases: Databases, round_trip: str
) -> None:
    url = databases.create(backend)
    command.downgrade(alembic_config(url), "0019")
    engine = create_sync_engine(url)
    with engine.begin() as conn:
        for statement in OLD_ROWS:
            conn.execute(text(statement), {"at": "2026-12-01 10:00:00+00"})
    upgrade(url)
    with engine.connect() as conn:
        for table in FILLED:
            actors = conn.execute(text(f"SELECT actor FROM {table}")).scalars().all()
            assert actors == ["shop-a"], table
    if round_trip == "and back":
        command.downgrade(alembic_config(url), "0019")
        with engine.connect() as conn:
            for table in FILLED:
                assert "actor" not in {c["name"] for c in inspect(conn).get_columns(table)}
                assert conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one() == 1
        upgrade(url)
    engine.dispose()


def _at_0019_with(backend: str, databases: Databases, statements: list[str]) -> str:
    """A database at revision 0019 holding `statements`' rows, foreign keys
    unchecked: as a database written with them off may hold."""
    url = databases.create(backend)
    command.downgrade(alembic_config(url), "0019")
    at = {"at": "2026-12-01 10:00:00+00"}
    if backend == "sqlite":
        with closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as raw:
            raw.execute("PRAGMA foreign_keys=OFF")
            for statement in statements:
                raw.execute(statement, at)
            raw.commit()
        return url
    engine = create_sync_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
        for statement in statements:
            conn.execute(text(statement), at)
    engine.dispose()
    return url


def test_a_row_whose_parent_is_missing_stops_migration_0020_before_any_change(
    backend: str, databases: Databases
) -> None:
    url = _at_0019_with(
        backend,
        databases,
        [OLD_ROWS[0], OLD_ROWS[1].replace("'op_1'", "'op_gone'"), OLD_ROWS[6]],
    )
    with pytest.raises(MigrationRefused) as refused:
        upgrade(url)
    assert "1 decisions rows whose operation_id names no operations row" in str(refused.value)
    assert "nothing was changed" in str(refused.value)
    assert current_revision(url) == "0019"


def test_a_sqlite_orphan_makes_the_whole_upgrade_fail_and_leaves_its_revision(
    databases: Databases,
) -> None:
    """The foreign key check runs before the migrations' one commit
    (migrations/env.py): a row no migration touches, naming a missing row, is
    found and the database stays where it was."""
    url = _at_0019_with(
        "sqlite",
        databases,
        [
            "INSERT INTO console_sessions (session_hash, api_key_id, created_at, expires_at) "
            "VALUES ('s', 404, :at, :at)"
        ],
    )
    with pytest.raises(MigrationRefused) as refused:
        upgrade(url)
    assert "console_sessions (rowid 1) -> api_keys" in str(refused.value)
    assert current_revision(url) == "0019"


@pytest.mark.parametrize(
    ("table", "row"),
    [
        (
            "attempts",
            "INSERT INTO attempts (operation_id, actor, number, provider_idempotency_key, "
            "submitted_at, relation, decision_id, source) "
            "VALUES ('op_1', 'shop-a', 1, 'pk', :at, 'original', 404, 's')",
        ),
        (
            "outbox",
            "INSERT INTO outbox (operation_id, actor, kind, due_at, deliveries, decision_id, "
            "created_at) VALUES ('op_1', 'shop-a', 'submit', :at, 0, 404, :at)",
        ),
        (
            "webhook_attempts",
            "INSERT INTO webhook_attempts (delivery_id, actor, at, duration_ms, delivered) "
            "VALUES (404, 'shop-a', :at, 5, false)",
        ),
    ],
)
def test_a_dangling_decision_or_delivery_is_refused(
    backend: str, databases: Databases, table: str, row: str
) -> None:
    engine = create_sync_engine(databases.create(backend))
    with engine.begin() as conn:
        conn.execute(text(OLD_ROWS[0]), {"at": "2026-12-01 10:00:00+00"})
    with pytest.raises(IntegrityError, match=r"(?i)foreign key"), engine.begin() as conn:
        conn.execute(text(row), {"at": "2026-12-01 10:00:00+00"})
    engine.dispose()
