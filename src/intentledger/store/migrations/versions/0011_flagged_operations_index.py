"""a partial index of the operations a flag holds for a person

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30

The API's /metrics counts flagged operations (outcome_contradicted,
duplicate_detected) at every scrape; without this index that count would read
every operation ever made. The index holds only the flagged few.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

FLAGGED = "outcome_contradicted OR duplicate_detected"


def upgrade() -> None:
    op.create_index(
        "ix_operations_flagged",
        "operations",
        ["updated_at"],
        sqlite_where=sa.text(FLAGGED),
        postgresql_where=sa.text(FLAGGED),
    )


def downgrade() -> None:
    op.drop_index("ix_operations_flagged", table_name="operations")
