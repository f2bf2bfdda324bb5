"""The ledger schema (SQLAlchemy Core), one definition for SQLite and PostgreSQL.

`operations` is the one mutable record per business operation. `attempts`,
`observations`, `transitions` and `decisions` are append-only: never updated,
never deleted, so a reviewer can rebuild what was seen and why from them alone.
An observation's bulky part, the provider's raw answer, is kept apart in
`observation_details`: past the record retention it goes, for settled
operations no one may still need (docs/decisions/0018) — on PostgreSQL with
the partition it lies in (store/partitions.py), on SQLite row by row.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Dialect,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    Interval,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.types import TypeDecorator

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in, aware UTC datetimes out, on both databases.

    SQLite has no time zones: it stores naive UTC in a fixed-width text form,
    which also keeps `<=` comparisons on due times correct.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the ledger; every instant is UTC-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return in_utc(value)

    def result_processor(
        self, dialect: Dialect, coltype: object
    ) -> Callable[[datetime | None], datetime | None] | None:
        if dialect.name == "postgresql":
            # The driver's (psycopg's) timestamptz needs nothing before this:
            # one call a value, not TypeDecorator's two around
            # `process_result_value` (a worker reads about 17 instants a payment).
            return in_utc
        return super().result_processor(dialect, coltype)


def in_utc(value: datetime | None) -> datetime | None:
    """An instant read back, as an aware UTC datetime (naive ones are UTC)."""
    if value is None or value.tzinfo is UTC:
        return value
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


Json = JSON().with_variant(JSONB(), "postgresql")

# One set of limits for validation and columns: an actor name fits every
# column that holds it, and every `source` ("api:<actor>", "operator:<actor>",
# a worker's id) fits its column whatever the actor.
ACTOR_LENGTH = 255
SOURCE_LENGTH = ACTOR_LENGTH + 32
# Settled and not yet reaped: the only operations `reap` ever looks at.
REAPABLE_PREDICATE = "reaped_at IS NULL AND state IN ('OUTCOME_KNOWN', 'CANCELLED')"
# A decision a person made (engine/operator.py writes their source so), through
# the console, the API or `intentledger ops`. Repeated verbatim in the query
# that counts them, which SQLite needs to use the partial index.
OPERATOR_DECISION = "source LIKE 'operator:%'"
# Every operation the console's work queue can ever show (which of them it shows
# depends on their age): domain/work_queue.py's reasons, as SQL. Repeated
# verbatim in the queue's queries, which SQLite needs to use the partial index.
WORK_QUEUE_PREDICATE = (
    "next_action = 'operator' OR duplicate_detected OR outcome_contradicted "
    "OR state IN ('UNKNOWN', 'RECONCILIATION_DUE', 'SAFETY_REVIEW')"
)


def _timestamp(name: str, nullable: bool = False) -> Column[Any]:
    return Column(name, UTCDateTime(), nullable=nullable)


# The distribution column (store/distribution.py): every table whose rows belong
# to an actor has it, in its primary key, its unique keys and its foreign keys
# to other such tables, so that a distribution by actor can keep an actor's
# rows of every table together.
def _actor() -> Column[Any]:
    return Column("actor", String(ACTOR_LENGTH), nullable=False)


def _of_operation() -> ForeignKeyConstraint:
    return ForeignKeyConstraint(
        ["operation_id", "actor"], ["operations.operation_id", "operations.actor"]
    )


# Where on SQLite only a unique index holds: Alembic's comparison of the
# migrated schema with this one takes it on SQLite alone (`declared_on`).
ONLY_ON = "only_on"


def _id_and_actor_unique_on_sqlite(table: str) -> Index:
    """What a foreign key by (id, actor) refers to on SQLite, where the id
    alone is the primary key (it is the rowid only so: store/distribution.py).
    On PostgreSQL the primary key is (id, actor) already, and a second index
    on the same columns would only slow every insert."""
    index = Index(f"uq_{table}_id_actor", "id", "actor", unique=True, info={ONLY_ON: "sqlite"})
    return index.ddl_if(dialect="sqlite")


def declared_on(dialect: str) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """Alembic's `include_object` for a database of `dialect`: what this
    schema declares for another dialect only is not expected there."""

    def include(item: Any, _name: str | None, _kind: str, reflected: bool, _other: Any) -> bool:
        only_on = None if reflected else getattr(item, "info", {}).get(ONLY_ON)
        return only_on is None or only_on == dialect

    return include


api_keys = Table(
    "api_keys",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("actor", String(ACTOR_LENGTH), nullable=False),
    Column("is_operator", Boolean, nullable=False, default=False),
    _timestamp("created_at"),
    # Set by `intentledger keys revoke`: the key authenticates nothing after.
    _timestamp("revoked_at", nullable=True),
)

# A signed-in operator console (console/session.py): the browser holds only a
# random id, stored here as its hash, with the key it was opened with. Signing
# out deletes the row; a revoked key ends every session opened with it.
console_sessions = Table(
    "console_sessions",
    metadata,
    Column("session_hash", String(64), primary_key=True),
    Column("api_key_id", Integer, ForeignKey("api_keys.id"), nullable=False),
    _timestamp("created_at"),
    _timestamp("expires_at"),
)

operations = Table(
    "operations",
    metadata,
    Column("operation_id", String(40), nullable=False),
    Column("idempotency_key", String(255), nullable=False),
    Column("state", String(24), nullable=False),
    Column("request_context", Json, nullable=False),
    _timestamp("first_attempt_at", nullable=True),
    _timestamp("last_observed_at", nullable=True),
    _timestamp("retry_after_at", nullable=True),
    Column("reconciliation_status", String(32), nullable=True),
    Column("key_age_at_decision", Interval, nullable=True),
    Column("provider_retention_note", Text, nullable=True),
    Column("next_action", String(16), nullable=False),
    _actor(),
    Column("route", String(64), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("request_hash", String(64), nullable=False),
    Column("provider", String(32), nullable=False),
    Column("provider_reference", String(255), nullable=True),
    Column("outcome", String(16), nullable=True),
    Column("amount", BigInteger, nullable=True),
    Column("currency", String(3), nullable=True),
    Column("mandate_id", String(40), nullable=True),
    Column("version", Integer, nullable=False),
    _timestamp("created_at"),
    _timestamp("updated_at"),
    # Two attempts that both executed (only possible after an approved new-key
    # request): flagged for a refund, never hidden.
    Column(
        "duplicate_detected", Boolean, nullable=False, default=False, server_default=text("false")
    ),
    # Evidence of success that arrived after the operation was settled failed
    # or cancelled: the books and the provider disagree, and a person must look.
    Column(
        "outcome_contradicted", Boolean, nullable=False, default=False, server_default=text("false")
    ),
    # Every provider reference some evidence showed executed (a list; NULL for
    # none beyond a settled success's provider_reference). Two distinct ones are
    # a duplicate; one under a failed or cancelled outcome is a contradiction.
    Column("executed_references", Json, nullable=True),
    # A refund's payment (the operation it reverses); NULL for every other kind.
    Column("parent_operation_id", String(40), nullable=True),
    # When `intentledger reap` removed its bulky rows (decision 0018); NULL: not reaped.
    _timestamp("reaped_at", nullable=True),
    # The highest id of its observations when it was reaped: a provider answer
    # with a higher id came later and outlives its partition (decision 0018).
    Column("reaped_through_observation", Integer, nullable=True),
    # Where watching the settled operation stands (domain/watching.Watch; NULL:
    # never watched), and the provider keys that may still execute as the last
    # evidence left them: its mandate share holds the amount once per live key.
    Column("watch", String(24), nullable=True),
    Column("live_keys", Integer, nullable=False, server_default=text("0")),
    PrimaryKeyConstraint("operation_id", "actor"),
    # The operator list filters by state; the sweeper by state and age.
    Index(None, "state", "updated_at"),
    Index(None, "parent_operation_id"),
    Index(None, "mandate_id"),
    # The console's work queue (store/work_queue.py): only what a person may be
    # asked about, oldest first.
    Index(
        "ix_operations_work_queue",
        "created_at",
        "operation_id",
        postgresql_where=text(WORK_QUEUE_PREDICATE),
        sqlite_where=text(WORK_QUEUE_PREDICATE),
    ),
    # What `reap` may take, oldest change first (store/reaping.py).
    Index(
        "ix_operations_reapable",
        "updated_at",
        sqlite_where=text(REAPABLE_PREDICATE),
        postgresql_where=text(REAPABLE_PREDICATE),
    ),
    # The flagged few a person must look at (/metrics counts them at each scrape).
    Index(
        "ix_operations_flagged",
        "updated_at",
        sqlite_where=text("outcome_contradicted OR duplicate_detected"),
        postgresql_where=text("outcome_contradicted OR duplicate_detected"),
    ),
)

idempotency_records = Table(
    "idempotency_records",
    metadata,
    Column("actor", String(ACTOR_LENGTH), primary_key=True),
    Column("route", String(64), primary_key=True),
    Column("idempotency_key", String(255), primary_key=True),
    Column("request_hash", String(64), nullable=False),
    # What the first request made or changed: an operation or a mandate id.
    Column("resource_id", String(40), nullable=False),
    _timestamp("created_at"),
)

decisions = Table(
    "decisions",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("operation_id", String(40), nullable=False),
    _timestamp("at"),
    Column("rule", String(64), nullable=False),
    Column("inputs", Json, nullable=False),
    Column("next_action", String(16), nullable=False),
    Column("reason", Text, nullable=False),
    Column("key_age_at_decision", Interval, nullable=True),
    Column("source", String(SOURCE_LENGTH), nullable=False),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    _id_and_actor_unique_on_sqlite("decisions"),
    _of_operation(),
    Index(None, "operation_id", "id"),
    # A person's decisions, few among the engine's: /metrics counts them at
    # each scrape (observability/ledger_gauges.py).
    Index(
        "ix_decisions_by_operator",
        "rule",
        sqlite_where=text(OPERATOR_DECISION),
        postgresql_where=text(OPERATOR_DECISION),
    ),
)

attempts = Table(
    "attempts",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("operation_id", String(40), nullable=False),
    Column("number", Integer, nullable=False),
    Column("provider_idempotency_key", String(255), nullable=False),
    _timestamp("submitted_at"),
    # "original", or "resubmission" of attempt `resubmission_of`.
    Column("relation", String(16), nullable=False),
    Column("resubmission_of", Integer, nullable=True),
    Column("decision_id", Integer, nullable=True),
    Column("source", String(SOURCE_LENGTH), nullable=False),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    _of_operation(),
    ForeignKeyConstraint(["decision_id", "actor"], ["decisions.id", "decisions.actor"]),
    UniqueConstraint("operation_id", "number", "actor"),
)

observations = Table(
    "observations",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("operation_id", String(40), nullable=False),
    _timestamp("at"),
    # submit_result, resumed_submitting, lookup_result, sweeper, operator, ...
    Column("kind", String(32), nullable=False),
    Column("source", String(SOURCE_LENGTH), nullable=False),
    Column("attempt_number", Integer, nullable=True),
    Column("transport", String(16), nullable=True),
    Column("error_class", String(64), nullable=True),
    Column("http_status", Integer, nullable=True),
    Column("verdict", String(16), nullable=True),
    Column("reason", Text, nullable=True),
    Column("provider_reference", String(255), nullable=True),
    Column("retry_after_raw", Text, nullable=True),
    _timestamp("retry_after_at", nullable=True),
    Column("retry_after_problem", String(32), nullable=True),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    _of_operation(),
    Index(None, "operation_id", "id"),
)

# An observation's provider answer, when it had one: the bulky part, which
# record retention removes (docs/decisions/0018). On PostgreSQL the table is
# range-partitioned by `retention_bucket` (the observation's `at` when
# written; store/partitions.py moves a row still needed past its partition's
# drop to the current one), so the primary key must hold it. No foreign key to
# `observations`: each row is written in the transaction of its observation,
# and a partitioned table's foreign key would make every partition attached
# or dropped lock `observations`, which every payment writes.
observation_details = Table(
    "observation_details",
    metadata,
    Column("observation_id", Integer, autoincrement=False),
    Column("retention_bucket", UTCDateTime()),
    Column("detail", Json, nullable=False),
    _actor(),
    PrimaryKeyConstraint("observation_id", "retention_bucket", "actor"),
    postgresql_partition_by="RANGE (retention_bucket)",
)

# Observations as they read: every column, and `detail` (NULL where there was
# no answer, or retention removed it).
observations_with_detail = (
    select(*observations.c, observation_details.c.detail)
    .select_from(
        observations.outerjoin(
            observation_details, observation_details.c.observation_id == observations.c.id
        )
    )
    .subquery("observations_with_detail")
)

transitions = Table(
    "transitions",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("operation_id", String(40), nullable=False),
    _timestamp("at"),
    Column("from_state", String(24), nullable=True),
    Column("to_state", String(24), nullable=False),
    Column("next_action", String(16), nullable=False),
    Column("reason", Text, nullable=False),
    Column("source", String(SOURCE_LENGTH), nullable=False),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    _of_operation(),
    Index(None, "operation_id", "id"),
)

mandates = Table(
    "mandates",
    metadata,
    Column("mandate_id", String(40), nullable=False),
    _actor(),
    Column("currency", String(3), nullable=False),
    Column("max_amount", BigInteger, nullable=False),
    Column("total_limit", BigInteger, nullable=False),
    # Held by operations whose outcome is not (yet) a known failure or cancellation.
    Column("reserved", BigInteger, nullable=False),
    Column("spent", BigInteger, nullable=False),
    Column("status", String(16), nullable=False),  # active | suspended | revoked
    Column("version", Integer, nullable=False),
    _timestamp("created_at"),
    _timestamp("updated_at"),
    PrimaryKeyConstraint("mandate_id", "actor"),
    Index(None, "actor"),
)

cards = Table(
    "cards",
    metadata,
    Column("card_id", String(40), nullable=False),
    _actor(),
    Column("label", String(100), nullable=True),
    # As wide as every provider reference (domain/transport.py, REFERENCE_WIDTH;
    # migration 0022).
    Column("provider_card_id", String(255), nullable=True),
    # pending (issue in flight) | active | frozen | not_issued
    Column("status", String(16), nullable=False),
    # True while an operation on the card has no known outcome.
    Column("indeterminate", Boolean, nullable=False),
    Column("pending_operation_id", String(40), nullable=True),
    Column("version", Integer, nullable=False),
    _timestamp("created_at"),
    _timestamp("updated_at"),
    PrimaryKeyConstraint("card_id", "actor"),
    Index(None, "actor"),
)

outbox = Table(
    "outbox",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("operation_id", String(40), nullable=False),
    Column("kind", String(16), nullable=False),  # submit | reconcile
    # When the row may next be claimed. A claim moves it to the end of the
    # lease, so an expired lease makes the row due again with no extra column.
    _timestamp("due_at"),
    Column("lease_owner", String(128), nullable=True),
    Column("deliveries", Integer, nullable=False, default=0),
    # The decision that authorised this submission, for every attempt after the
    # first.
    Column("decision_id", Integer, nullable=True),
    _timestamp("done_at", nullable=True),
    _timestamp("created_at"),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    _of_operation(),
    ForeignKeyConstraint(["decision_id", "actor"], ["decisions.id", "decisions.actor"]),
    # Equal due times are claimed in the order the rows were made (migration 0021).
    Index(
        "ix_outbox_pending_due",
        "due_at",
        "id",
        sqlite_where=text("done_at IS NULL"),
        postgresql_where=text("done_at IS NULL"),
    ),
    Index(None, "operation_id"),
)

# A provider's webhooks, each stored once by its event id (a redelivery finds
# its row and changes nothing). `disposition` says what became of it: applied
# to an operation, about a reference we do not know, a type the adapter does
# not map. The payload is kept as verified, for the reviewer.
provider_events = Table(
    "provider_events",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("provider", String(40), nullable=False),
    Column("event_id", String(255), nullable=False),
    Column("type", String(100), nullable=False),
    _timestamp("received_at"),
    _timestamp("signed_at"),
    Column("object_id", String(255), nullable=True),
    Column("reference", String(255), nullable=True),
    Column("operation_id", String(40), nullable=True),
    Column("disposition", String(32), nullable=False),
    Column("payload", Json, nullable=False),
    # Distributed by event_id on its own (store/distribution.py).
    PrimaryKeyConstraint("id", "event_id"),
    UniqueConstraint("provider", "event_id"),
    Index(None, "operation_id"),
)

# A merchant's webhook endpoint: where an actor's events go. The signing secret
# is kept as given out (HMAC needs the key itself, so it cannot be hashed like a
# token); a deleted endpoint keeps its row and its delivery history.
webhook_endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("endpoint_id", String(40), nullable=False),
    _actor(),
    Column("url", Text, nullable=False),
    # The event types it takes; NULL for every type.
    Column("events", Json, nullable=True),
    Column("secret", String(64), nullable=False),
    _timestamp("created_at"),
    _timestamp("deleted_at", nullable=True),
    PrimaryKeyConstraint("endpoint_id", "actor"),
    Index(None, "actor"),
)

# One row per piece of news, written in the transaction of the change it
# reports; `payload` is the body every endpoint receives, byte for byte the
# same on every retry (the signature covers it and the message id).
merchant_events = Table(
    "merchant_events",
    metadata,
    Column("event_id", String(40), nullable=False),
    _actor(),
    Column("type", String(40), nullable=False),
    Column("object_id", String(40), nullable=False),
    Column("payload", Text, nullable=False),
    _timestamp("created_at"),
    PrimaryKeyConstraint("event_id", "actor"),
    # The console shows an operation's (or mandate's, card's) events.
    Index(None, "object_id"),
)

# An event on its way to one endpoint: leased like an outbox row while an
# attempt is in flight (`due_at` moves to the lease's end), then delivered,
# due again later, or given up as failed.
webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("event_id", String(40), nullable=False),
    Column("endpoint_id", String(40), nullable=False),
    # pending | delivered | failed (given up) | cancelled (endpoint deleted)
    Column("status", String(16), nullable=False),
    _timestamp("due_at"),
    Column("lease_owner", String(128), nullable=True),
    Column("attempts", Integer, nullable=False),
    _timestamp("created_at"),
    _timestamp("finished_at", nullable=True),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    _id_and_actor_unique_on_sqlite("webhook_deliveries"),
    ForeignKeyConstraint(
        ["event_id", "actor"], ["merchant_events.event_id", "merchant_events.actor"]
    ),
    ForeignKeyConstraint(
        ["endpoint_id", "actor"], ["webhook_endpoints.endpoint_id", "webhook_endpoints.actor"]
    ),
    # Equal due times are claimed in the order the rows were made (migration 0021).
    Index(
        "ix_webhook_deliveries_pending_due",
        "due_at",
        "id",
        sqlite_where=text("status = 'pending'"),
        postgresql_where=text("status = 'pending'"),
    ),
    Index(None, "endpoint_id", "id"),
    # The rows in flight: what the per-endpoint limit counts.
    Index(
        "ix_webhook_deliveries_leased",
        "endpoint_id",
        sqlite_where=text("lease_owner IS NOT NULL AND status = 'pending'"),
        postgresql_where=text("lease_owner IS NOT NULL AND status = 'pending'"),
    ),
)

# Every attempt to deliver, as it went: kept for the merchant's list.
webhook_attempts = Table(
    "webhook_attempts",
    metadata,
    # On SQLite the id alone is the key (store/distribution.py).
    Column("id", Integer, autoincrement=True),
    Column("delivery_id", Integer, nullable=False),
    _timestamp("at"),
    Column("duration_ms", Integer, nullable=False),
    Column("http_status", Integer, nullable=True),
    # Why it failed where no status says it: a transport error class, a refusal.
    Column("error", Text, nullable=True),
    Column("delivered", Boolean, nullable=False),
    _timestamp("next_attempt_at", nullable=True),
    _actor(),
    PrimaryKeyConstraint("id", "actor"),
    ForeignKeyConstraint(
        ["delivery_id", "actor"], ["webhook_deliveries.id", "webhook_deliveries.actor"]
    ),
    Index(None, "delivery_id", "id"),
)
