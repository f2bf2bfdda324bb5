"""duplicate flag and state age index

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:

    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "duplicate_detected", sa.Boolean(), server_default=sa.text("false"), nullable=False
            )
        )
        batch_op.drop_index(batch_op.f("ix_operations_state_retry_after_at"))
        batch_op.create_index(
            batch_op.f("ix_operations_state_updated_at"), ["state", "updated_at"], unique=False
        )


def downgrade() -> None:

    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operations_state_updated_at"))
        batch_op.create_index(
            batch_op.f("ix_operations_state_retry_after_at"),
            ["state", "retry_after_at"],
            unique=False,
        )
        batch_op.drop_column("duplicate_detected")
