"""refunds: an operation's parent (the payment a refund reverses)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("parent_operation_id", sa.String(length=40), nullable=True))
        batch_op.create_index(
            batch_op.f("ix_operations_parent_operation_id"), ["parent_operation_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operations_parent_operation_id"))
        batch_op.drop_column("parent_operation_id")
