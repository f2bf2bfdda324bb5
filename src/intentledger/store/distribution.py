"""Where each table would live on a distributed PostgreSQL (Citus), declared
once: tests/test_schema_distribution.py holds the migrated schema to it, and
docs/scaling.md ("Past one primary") quotes it.

Everything the ledger guarantees is per operation, and every operation
belongs to one actor, so the ledger is distributed by `actor`: every table
whose rows belong to an actor carries the column, in its primary key, in
every unique constraint and in every foreign key to another such table, so
that Citus can place an actor's rows of every table on one shard
(`colocate_with`) and run each per-actor transaction on one node. Tables that
belong to no actor are either small, read on every request and rarely written
(reference tables, copied whole to every node), or keyed by something
else (distributed by their own key, in a co-location group of their own).

SQLite is never distributed, and one of its limits shows in the migrated
schema: a serial id is SQLite's rowid only when it is the whole primary key,
so there a table with a serial id keeps `PRIMARY KEY (id)` where PostgreSQL
has `PRIMARY KEY (id, actor)` (migration 0020).
"""

from __future__ import annotations

from dataclasses import dataclass

DISTRIBUTION_COLUMN = "actor"
# The table every co-located table is placed with: the operations' shards.
ANCHOR = "operations"


@dataclass(frozen=True)
class ByActor:
    """Distributed by `actor`, co-located with the operations."""

    why: str


@dataclass(frozen=True)
class Reference:
    """A reference table: one copy on every node; no foreign key to a table
    distributed by actor (Citus refuses one)."""

    why: str


@dataclass(frozen=True)
class OwnKey:
    """Distributed by a column of its own, in a co-location group of its own."""

    column: str
    why: str


Placement = ByActor | Reference | OwnKey

# In the order Citus must distribute them: a table after every table it refers to.
TABLES: dict[str, Placement] = {
    "api_keys": Reference(
        "every request reads it (by token hash), a person writes it (keys create, revoke): "
        "a handful of rows, read on every node without a network hop"
    ),
    "console_sessions": Reference(
        "refers to api_keys (a reference table); a row per signed-in operator, "
        "written at sign-in and sign-out only"
    ),
    "operations": ByActor("the anchor: an operation belongs to one actor for ever"),
    "idempotency_records": ByActor("keyed by (actor, route, key) since migration 0003"),
    "decisions": ByActor("an operation's decisions; refers to it by (operation_id, actor)"),
    "attempts": ByActor("an operation's attempts; unique by (operation_id, number, actor)"),
    "observations": ByActor("an operation's observations"),
    "observation_details": ByActor(
        "an observation's provider answer; range-partitioned by retention_bucket on "
        "PostgreSQL, and Citus distributes a partitioned table with its partitions"
    ),
    "transitions": ByActor("an operation's transitions"),
    "mandates": ByActor("a mandate and every payment under it belong to one actor"),
    "cards": ByActor("a card and its operations belong to one actor"),
    "outbox": ByActor(
        "an operation's deliveries: the claim runs per actor's shard (docs/scaling.md)"
    ),
    "merchant_events": ByActor("an actor's news, written in the transaction of the change"),
    "webhook_endpoints": ByActor("an actor's endpoints"),
    "webhook_deliveries": ByActor(
        "an event on its way to one endpoint of the same actor; refers to both by (id, actor)"
    ),
    "webhook_attempts": ByActor("a delivery's attempts"),
    "provider_events": OwnKey(
        "event_id",
        "stored once by (provider, event_id) before the operation it names is known "
        "(or when it names none): the actor cannot be in its unique key, so it is "
        "distributed by event_id on its own; the receipt then writes two shards "
        "(docs/scaling.md)",
    ),
}

# Foreign keys between tables distributed by actor that are not declared, and why:
# (table, column) -> reason. Each names a serial id, which on SQLite is only the
# rowid when it is the whole key (see above), so a foreign key by (id, actor)
# has nothing unique to refer to there; PostgreSQL and SQLite keep one schema.
UNDECLARED_FOREIGN_KEYS: dict[tuple[str, str], str] = {
    ("attempts", "decision_id"): (
        "the decision is written by the same unit of work, just before (Ledger.save)"
    ),
    ("outbox", "decision_id"): (
        "the decision is written by the same unit of work, just before (Ledger.save)"
    ),
    ("webhook_attempts", "delivery_id"): (
        "written for a delivery this worker holds leased; deliveries are never deleted"
    ),
}


def citus_statements() -> list[str]:
    """The calls that distribute a migrated ledger on Citus, in order."""
    statements = []
    for table, placement in TABLES.items():
        if isinstance(placement, Reference):
            statements.append(f"SELECT create_reference_table('{table}')")
        elif isinstance(placement, OwnKey):
            statements.append(
                f"SELECT create_distributed_table('{table}', '{placement.column}', "
                "colocate_with => 'none')"
            )
        elif table == ANCHOR:
            statements.append(
                f"SELECT create_distributed_table('{table}', '{DISTRIBUTION_COLUMN}')"
            )
        else:
            statements.append(
                f"SELECT create_distributed_table('{table}', '{DISTRIBUTION_COLUMN}', "
                f"colocate_with => '{ANCHOR}')"
            )
    return statements
