"""merchant webhooks: endpoints, events, deliveries and their attempts

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
INSTANT = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", JSON, nullable=True),
        sa.Column("secret", sa.String(length=64), nullable=False),
        sa.Column("created_at", INSTANT, nullable=False),
        sa.Column("deleted_at", INSTANT, nullable=True),
        sa.PrimaryKeyConstraint("endpoint_id", name=op.f("pk_webhook_endpoints")),
    )
    op.create_index(
        op.f("ix_webhook_endpoints_actor"), "webhook_endpoints", ["actor"], unique=False
    )
    op.create_table(
        "merchant_events",
        sa.Column("event_id", sa.String(length=40), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("type", sa.String(length=40), nullable=False),
        sa.Column("object_id", sa.String(length=40), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("created_at", INSTANT, nullable=False),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_merchant_events")),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("event_id", sa.String(length=40), nullable=False),
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("due_at", INSTANT, nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("created_at", INSTANT, nullable=False),
        sa.Column("finished_at", INSTANT, nullable=True),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["webhook_endpoints.endpoint_id"],
            name=op.f("fk_webhook_deliveries_endpoint_id_webhook_endpoints"),
        ),
        sa.ForeignKeyConstraint(
            ["event_id"],
            ["merchant_events.event_id"],
            name=op.f("fk_webhook_deliveries_event_id_merchant_events"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        "ix_webhook_deliveries_pending_due",
        "webhook_deliveries",
        ["due_at"],
        unique=False,
        sqlite_where=sa.text("status = 'pending'"),
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        op.f("ix_webhook_deliveries_endpoint_id_id"),
        "webhook_deliveries",
        ["endpoint_id", "id"],
        unique=False,
    )
    op.create_index(
        "ix_webhook_deliveries_leased",
        "webhook_deliveries",
        ["endpoint_id"],
        unique=False,
        sqlite_where=sa.text("lease_owner IS NOT NULL AND status = 'pending'"),
        postgresql_where=sa.text("lease_owner IS NOT NULL AND status = 'pending'"),
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("delivery_id", sa.Integer(), nullable=False),
        sa.Column("at", INSTANT, nullable=False),
        sa.Column("duration_ms", sa.Integer(), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("delivered", sa.Boolean(), nullable=False),
        sa.Column("next_attempt_at", INSTANT, nullable=True),
        sa.ForeignKeyConstraint(
            ["delivery_id"],
            ["webhook_deliveries.id"],
            name=op.f("fk_webhook_attempts_delivery_id_webhook_deliveries"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_attempts")),
    )
    op.create_index(
        op.f("ix_webhook_attempts_delivery_id_id"),
        "webhook_attempts",
        ["delivery_id", "id"],
        unique=False,
    )


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_index("ix_webhook_deliveries_leased", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_pending_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_table("merchant_events")
    op.drop_table("webhook_endpoints")
