"""a card's provider id is as wide as every other provider reference

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07

A provider reference is kept to 255 characters wherever the ledger records one
(domain/transport.py, REFERENCE_WIDTH), but a card's provider id had a column
of 64: on PostgreSQL a card issue answered with a longer id could not be
recorded, so the card stayed pending and its issue SUBMITTING at every look
(SQLite does not enforce the length). Widening a varchar is a change of the
catalogue alone on PostgreSQL: no row is rewritten.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("cards", schema=None) as batch_op:
        batch_op.alter_column("provider_card_id", type_=sa.String(255), existing_type=sa.String(64))


def downgrade() -> None:
    # A card id wider than 64 characters would not fit back: the downgrade
    # refuses it (PostgreSQL) rather than cut an id the provider answers by.
    with op.batch_alter_table("cards", schema=None) as batch_op:
        batch_op.alter_column("provider_card_id", type_=sa.String(64), existing_type=sa.String(255))
