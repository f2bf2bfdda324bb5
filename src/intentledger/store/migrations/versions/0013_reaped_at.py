"""record retention: operations.reaped_at and the index reap reads through

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# Written out so this migration keeps meaning what it meant (store/tables.py).
REAPABLE = "reaped_at IS NULL AND state IN ('OUTCOME_KNOWN', 'CANCELLED')"


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reaped_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_operations_reapable",
        "operations",
        ["updated_at"],
        postgresql_where=sa.text(REAPABLE),
        sqlite_where=sa.text(REAPABLE),
    )


def downgrade() -> None:
    op.drop_index("ix_operations_reapable", table_name="operations")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_column("reaped_at")
