"""a partial index of the decisions a person made

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04

The API's /metrics counts operator actions by rule at every scrape
(`intentledger_operator_actions_total`), read from the decisions because
`intentledger ops` acts from a process no one scrapes. Without this index that
count would read every decision ever made; the index holds only a person's.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

OPERATOR_DECISION = "source LIKE 'operator:%'"


def upgrade() -> None:
    op.create_index(
        "ix_decisions_by_operator",
        "decisions",
        ["rule"],
        sqlite_where=sa.text(OPERATOR_DECISION),
        postgresql_where=sa.text(OPERATOR_DECISION),
    )


def downgrade() -> None:
    op.drop_index("ix_decisions_by_operator", table_name="decisions")
