"""intake's one writer: every accepted intent through `intentledger_accept_group`

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05

Migration 0015's function wrote the intents of a group; an intent accepted on
its own (a mandate's payment, a refund, a card, a synchronous write) had its
own INSERTs. Now every accepted intent goes through the one writer
(store/intake.py), on PostgreSQL this function, which therefore also takes:

- `parent_operation_id` among the rows' columns (a refund names its payment);
- `given_keys_claimed`: the intents' keys were claimed earlier in the same
  transaction (an intent with checks of its own claims its key before them,
  so that a concurrent equal request waits and replays instead of being
  judged by them), so the function writes every row without claiming;
- the submit rows' start, `given_due_at`, `given_lease_owner` and
  `given_deliveries`: due now, or leased from the start to the API process
  that delivers it in the request path;

and it returns each new operation's id with its submit row's id (the request
path delivers that row). Keys are claimed in key order as before, and of two
rows with one key the earlier in the group claims it (`WITH ORDINALITY`), as
on SQLite, so the outcome never depends on how the server sorts ties.

The columns are what `operation_values` writes (engine/intake.py) with the
types of `operations` at this revision; `ACCEPT_GROUP_COLUMNS`
(store/intake.py) lists them and a test holds the two together.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

SIGNATURE = (
    "intentledger_accept_group(jsonb, timestamptz, text, text, text, text, "
    "boolean, timestamptz, text, integer)"
)

# Parameters are named given_*, the result's columns new_*: a PL/pgSQL name
# equal to a column's (next_action, reason, operation_id) would make the
# statement's references ambiguous.
FUNCTION = """
CREATE OR REPLACE FUNCTION intentledger_accept_group(
    given_rows jsonb,
    given_now timestamptz,
    given_from_state text,
    given_to_state text,
    given_next_action text,
    given_reason text,
    given_keys_claimed boolean,
    given_due_at timestamptz,
    given_lease_owner text,
    given_deliveries integer
) RETURNS TABLE (new_operation_id varchar, new_outbox_row_id integer)
LANGUAGE plpgsql VOLATILE AS $function$
BEGIN
    RETURN QUERY
    WITH accepted AS (
        SELECT * FROM ROWS FROM (jsonb_to_recordset(given_rows) AS (
            operation_id VARCHAR(40), idempotency_key VARCHAR(255), state VARCHAR(24),
            request_context JSONB, next_action VARCHAR(16), actor VARCHAR(255),
            route VARCHAR(64), kind VARCHAR(32), request_hash VARCHAR(64),
            provider VARCHAR(32), amount BIGINT, currency VARCHAR(3), mandate_id VARCHAR(40),
            parent_operation_id VARCHAR(40), version INTEGER, duplicate_detected BOOLEAN,
            outcome_contradicted BOOLEAN, created_at TIMESTAMP WITH TIME ZONE,
            updated_at TIMESTAMP WITH TIME ZONE, transition_source text
        )) WITH ORDINALITY AS r
    ), claimed AS (
        INSERT INTO idempotency_records
            (actor, route, idempotency_key, request_hash, resource_id, created_at)
        SELECT a.actor, a.route, a.idempotency_key, a.request_hash, a.operation_id, given_now
        FROM accepted AS a
        WHERE NOT given_keys_claimed
        ORDER BY a.actor, a.route, a.idempotency_key, a.ordinality
        ON CONFLICT (actor, route, idempotency_key) DO NOTHING
        RETURNING idempotency_records.resource_id
    ), new AS (
        SELECT a.* FROM accepted AS a
        WHERE given_keys_claimed OR a.operation_id IN (SELECT c.resource_id FROM claimed AS c)
    ), new_operations AS (
        INSERT INTO operations (
            operation_id, idempotency_key, state, request_context, next_action, actor,
            route, kind, request_hash, provider, amount, currency, mandate_id,
            parent_operation_id, version, duplicate_detected, outcome_contradicted,
            created_at, updated_at
        )
        SELECT
            n.operation_id, n.idempotency_key, n.state, n.request_context, n.next_action,
            n.actor, n.route, n.kind, n.request_hash, n.provider, n.amount, n.currency,
            n.mandate_id, n.parent_operation_id, n.version, n.duplicate_detected,
            n.outcome_contradicted, n.created_at, n.updated_at
        FROM new AS n
    ), new_outbox AS (
        INSERT INTO outbox (operation_id, kind, due_at, lease_owner, deliveries, created_at)
        SELECT n.operation_id, 'submit', given_due_at, given_lease_owner, given_deliveries,
            given_now
        FROM new AS n
        RETURNING outbox.operation_id, outbox.id
    ), new_transitions AS (
        INSERT INTO transitions
            (operation_id, at, from_state, to_state, next_action, reason, source)
        SELECT
            n.operation_id, given_now, given_from_state, given_to_state, given_next_action,
            given_reason, n.transition_source
        FROM new AS n
    )
    SELECT o.operation_id, o.id FROM new_outbox AS o;
END
$function$
"""


def _migration_0015() -> ModuleType:
    """Migration 0015, whose function this one replaces (and a downgrade brings back)."""
    path = Path(__file__).with_name("0015_accept_group_function.py")
    spec = importlib.util.spec_from_file_location("_intentledger_migration_0015", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {_migration_0015().SIGNATURE}")
        op.execute(FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
        op.execute(_migration_0015().FUNCTION)
