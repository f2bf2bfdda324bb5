"""source columns hold any actor: 'operator:' + a 255-character name

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# A 128-character `source` could not hold "api:" or "operator:" and an actor
# name of more than ~120 characters: every write of such an actor failed on
# PostgreSQL (SQLite does not enforce the length). tables.SOURCE_LENGTH.
TABLES = ("attempts", "observations", "transitions", "decisions")
SOURCE_LENGTH = 255 + 32


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column(
                "source", type_=sa.String(SOURCE_LENGTH), existing_type=sa.String(128)
            )


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.alter_column(
                "source", type_=sa.String(128), existing_type=sa.String(SOURCE_LENGTH)
            )
