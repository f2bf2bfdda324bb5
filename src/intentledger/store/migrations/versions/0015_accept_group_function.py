"""intake's group statement as a PL/pgSQL function, PostgreSQL only

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01

A grouped intake (engine/group_intake.py) is one statement. Behind a pooler in
transaction mode nothing is prepared (store/database.py), so PostgreSQL parsed
and planned that statement for every group: 0.13 ms of server CPU per intent
through PgBouncer against 0.08 straight to the server (docs/benchmarks.md). In a
PL/pgSQL function the statement's plan is kept on each server connection,
whichever client sends the call, and the call itself is a one-line statement.

The rows' columns are written out: they are what `operation_values` writes
(engine/intake.py) with the types of `operations` at this revision. A later
migration that changes either replaces this function with CREATE OR REPLACE;
`BatchLedger` uses the function only for rows with exactly these columns
(`ACCEPT_GROUP_COLUMNS`, store/batches.py), and a test holds the two together.
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

SIGNATURE = "intentledger_accept_group(jsonb, timestamptz, text, text, text, text)"

# Parameters are named given_*: a PL/pgSQL parameter named like a column
# (next_action, reason) would make the statement's references ambiguous.
FUNCTION = """
CREATE OR REPLACE FUNCTION intentledger_accept_group(
    given_rows jsonb,
    given_now timestamptz,
    given_from_state text,
    given_to_state text,
    given_next_action text,
    given_reason text
) RETURNS SETOF varchar
LANGUAGE plpgsql VOLATILE AS $function$
BEGIN
    RETURN QUERY
    WITH accepted AS (
        SELECT * FROM jsonb_to_recordset(given_rows) AS r(
            operation_id VARCHAR(40), idempotency_key VARCHAR(255), state VARCHAR(24),
            request_context JSONB, next_action VARCHAR(16), actor VARCHAR(255),
            route VARCHAR(64), kind VARCHAR(32), request_hash VARCHAR(64),
            provider VARCHAR(32), amount BIGINT, currency VARCHAR(3), mandate_id VARCHAR(40),
            version INTEGER, duplicate_detected BOOLEAN, outcome_contradicted BOOLEAN,
            created_at TIMESTAMP WITH TIME ZONE, updated_at TIMESTAMP WITH TIME ZONE,
            transition_source text
        )
    ), claimed AS (
        INSERT INTO idempotency_records
            (actor, route, idempotency_key, request_hash, resource_id, created_at)
        SELECT a.actor, a.route, a.idempotency_key, a.request_hash, a.operation_id, given_now
        FROM accepted AS a
        ORDER BY a.actor, a.route, a.idempotency_key
        ON CONFLICT (actor, route, idempotency_key) DO NOTHING
        RETURNING idempotency_records.resource_id
    ), new AS (
        SELECT a.* FROM accepted AS a
        JOIN claimed AS c ON c.resource_id = a.operation_id
    ), new_operations AS (
        INSERT INTO operations (
            operation_id, idempotency_key, state, request_context, next_action, actor,
            route, kind, request_hash, provider, amount, currency, mandate_id, version,
            duplicate_detected, outcome_contradicted, created_at, updated_at
        )
        SELECT
            n.operation_id, n.idempotency_key, n.state, n.request_context, n.next_action,
            n.actor, n.route, n.kind, n.request_hash, n.provider, n.amount, n.currency,
            n.mandate_id, n.version, n.duplicate_detected, n.outcome_contradicted,
            n.created_at, n.updated_at
        FROM new AS n
    ), new_outbox AS (
        INSERT INTO outbox (operation_id, kind, due_at, deliveries, created_at)
        SELECT n.operation_id, 'submit', given_now, 0, given_now FROM new AS n
    ), new_transitions AS (
        INSERT INTO transitions
            (operation_id, at, from_state, to_state, next_action, reason, source)
        SELECT
            n.operation_id, given_now, given_from_state, given_to_state, given_next_action,
            given_reason, n.transition_source
        FROM new AS n
    )
    SELECT c.resource_id FROM claimed AS c;
END
$function$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP FUNCTION IF EXISTS {SIGNATURE}")
