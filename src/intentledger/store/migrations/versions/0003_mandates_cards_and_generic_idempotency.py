"""mandates cards and generic idempotency

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cards",
        sa.Column("card_id", sa.String(length=40), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("label", sa.String(length=100), nullable=True),
        sa.Column("provider_card_id", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("indeterminate", sa.Boolean(), nullable=False),
        sa.Column("pending_operation_id", sa.String(length=40), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("card_id", name=op.f("pk_cards")),
    )
    with op.batch_alter_table("cards", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_cards_actor"), ["actor"], unique=False)

    op.create_table(
        "mandates",
        sa.Column("mandate_id", sa.String(length=40), nullable=False),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("max_amount", sa.BigInteger(), nullable=False),
        sa.Column("total_limit", sa.BigInteger(), nullable=False),
        sa.Column("reserved", sa.BigInteger(), nullable=False),
        sa.Column("spent", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("mandate_id", name=op.f("pk_mandates")),
    )
    with op.batch_alter_table("mandates", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_mandates_actor"), ["actor"], unique=False)

    # Records now name what they made or changed: an operation or a mandate.
    # Renamed in place so existing records keep working.
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_idempotency_records_operation_id_operations"), type_="foreignkey"
        )
        batch_op.alter_column("operation_id", new_column_name="resource_id")


def downgrade() -> None:
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.alter_column("resource_id", new_column_name="operation_id")
        batch_op.create_foreign_key(
            batch_op.f("fk_idempotency_records_operation_id_operations"),
            "operations",
            ["operation_id"],
            ["operation_id"],
        )

    with op.batch_alter_table("mandates", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_mandates_actor"))

    op.drop_table("mandates")
    with op.batch_alter_table("cards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_cards_actor"))

    op.drop_table("cards")
