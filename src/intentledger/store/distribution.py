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
has `PRIMARY KEY (id, actor)` (migration 0020). Where a foreign key refers to
such a table by (id, actor) (decisions, webhook_deliveries), SQLite has a
unique index on (id, actor) for it to refer to (tables.py).

What the database no longer guarantees: with the actor in every key, an
operation id (and a mandate, card, merchant event or endpoint id) is unique
only with its actor, and on PostgreSQL a serial id only with its actor too.
No two actors get the same id because the server makes each id:
`new_operation_id()` (store/ledger.py) and the mandate, card, event and
endpoint ids (engine/) are 96 random bits from `secrets`, never taken from a
request; serial ids come from the table's sequence, which never repeats. A
collision of two random ids among n ids has a chance of about n^2 / 2^97: one
in 10^11 after a billion operations. Were it to happen, lookups by the id
alone would meet two rows: `Ledger.get_operation` would take one of them
(`.first()`, in no stated order), `lock_operation` would raise
(`scalar_one_or_none` on two rows), and `write_operation_change` (by id and
version) would update both if their versions matched, or raise
`ConcurrentUpdate`. It is accepted for that chance. A unique index on the id
alone, kept outside Citus, would break the rule this module holds the schema
to (every unique key holds the actor), and once the lookups name the actor
(docs/scaling.md) a collision no longer reaches them.
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

# A column of a table distributed by actor that names a row of another such
# table has a foreign key by (column, actor), unless it is listed here with the
# reason: (table, column) -> reason. tests/test_schema_distribution.py holds
# the schema to it, and every entry to a column without a foreign key.
UNDECLARED_FOREIGN_KEYS: dict[tuple[str, str], str] = {
    ("observation_details", "observation_id"): (
        "partitioned on PostgreSQL: a foreign key would make every partition attached or "
        "dropped lock observations, which every payment writes (tables.py)"
    ),
    ("operations", "mandate_id"): (
        "never declared, nor before migration 0020: intake locks the mandate and checks it is "
        "the actor's in the operation's transaction (engine/mandates.py); one by "
        "(mandate_id, actor) is possible now, left to a later migration"
    ),
    ("operations", "parent_operation_id"): (
        "never declared, nor before migration 0020: a refund's payment is locked and checked "
        "in the refund's transaction (engine/refunds.py); one by (parent_operation_id, actor) "
        "is possible now, left to a later migration"
    ),
    ("cards", "pending_operation_id"): (
        "a card being issued is written naming its operation before that operation's row, "
        "in the same transaction (engine/cards.py): an immediate foreign key would refuse it"
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
