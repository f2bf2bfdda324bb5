"""the pending indexes order equal due times by id

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-06

A claim takes the earliest due outbox rows or webhook deliveries. Rows made in
one transaction share their due time, and on PostgreSQL an index on `due_at`
alone hands out equal keys in the order their row versions happen to lie on
disk, which moves with every update and with what VACUUM has freed. A claim
now orders by (`due_at`, `id`): equal due times go in the order the rows were
made, on both databases, and these indexes serve that order without a sort.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# (table, index, the predicate of its pending rows)
PENDING_INDEXES = (
    ("outbox", "ix_outbox_pending_due", "done_at IS NULL"),
    ("webhook_deliveries", "ix_webhook_deliveries_pending_due", "status = 'pending'"),
)


def _rebuild(columns: list[str]) -> None:
    for table, index, pending in PENDING_INDEXES:
        op.drop_index(index, table_name=table)
        op.create_index(
            index,
            table,
            columns,
            sqlite_where=sa.text(pending),
            postgresql_where=sa.text(pending),
        )


def upgrade() -> None:
    _rebuild(["due_at", "id"])


def downgrade() -> None:
    _rebuild(["due_at"])
