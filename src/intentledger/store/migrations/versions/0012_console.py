"""console: sessions; the work queue's partial index; operations by mandate; events by object

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# Written out (not imported) so this migration keeps meaning what it meant
# when the code's predicate changes; store/work_queue.py holds the same text.
QUEUE_PREDICATE = (
    "next_action = 'operator' OR duplicate_detected OR outcome_contradicted "
    "OR state IN ('UNKNOWN', 'RECONCILIATION_DUE', 'SAFETY_REVIEW')"
)


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column("session_hash", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["api_key_id"], ["api_keys.id"]),
        sa.PrimaryKeyConstraint("session_hash"),
    )
    op.create_index(
        "ix_operations_work_queue",
        "operations",
        ["created_at", "operation_id"],
        postgresql_where=sa.text(QUEUE_PREDICATE),
        sqlite_where=sa.text(QUEUE_PREDICATE),
    )
    op.create_index("ix_operations_mandate_id", "operations", ["mandate_id"])
    op.create_index("ix_merchant_events_object_id", "merchant_events", ["object_id"])


def downgrade() -> None:
    op.drop_index("ix_merchant_events_object_id", table_name="merchant_events")
    op.drop_index("ix_operations_mandate_id", table_name="operations")
    op.drop_index("ix_operations_work_queue", table_name="operations")
    op.drop_table("console_sessions")
