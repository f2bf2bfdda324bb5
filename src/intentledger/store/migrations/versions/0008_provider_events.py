"""provider events: a provider's webhooks, each stored once

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "provider_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("provider", sa.String(length=40), nullable=False),
        sa.Column("event_id", sa.String(length=255), nullable=False),
        sa.Column("type", sa.String(length=100), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("object_id", sa.String(length=255), nullable=True),
        sa.Column("reference", sa.String(length=255), nullable=True),
        sa.Column("operation_id", sa.String(length=40), nullable=True),
        sa.Column("disposition", sa.String(length=32), nullable=False),
        sa.Column(
            "payload", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_provider_events")),
        sa.UniqueConstraint(
            "provider", "event_id", name=op.f("uq_provider_events_provider_event_id")
        ),
    )
    with op.batch_alter_table("provider_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_provider_events_operation_id"), ["operation_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("provider_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_provider_events_operation_id"))
    op.drop_table("provider_events")
