"""record retention: observations' provider answers in their own table,
range-partitioned by month on PostgreSQL (decision 0018)

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01

The answers are copied with one INSERT ... SELECT, not in batches: dropping
`observations.detail` takes an exclusive lock on `observations` until this
migration commits, so the migration runs with the writers stopped whatever the
copy's size, and batches inside its one transaction would only make the copy
slower. The partitions are created before the copy, so every row goes straight
to its month rather than through the default partition.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _month_partition(year: int, month: int) -> str:
    upper = (year + 1, 1) if month == 12 else (year, month + 1)
    return (
        f"CREATE TABLE observation_details_{year:04d}_{month:02d} PARTITION OF "
        f"observation_details FOR VALUES FROM ('{year:04d}-{month:02d}-01 00:00:00+00') "
        f"TO ('{upper[0]:04d}-{upper[1]:02d}-01 00:00:00+00')"
    )


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "observation_details",
        sa.Column("observation_id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("retention_bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("detail", _json(), nullable=False),
        sa.PrimaryKeyConstraint(
            "observation_id", "retention_bucket", name=op.f("pk_observation_details")
        ),
        postgresql_partition_by="RANGE (retention_bucket)",
    )
    if postgres:
        op.execute(
            "CREATE TABLE observation_details_default PARTITION OF observation_details DEFAULT"
        )
        # The months the existing answers fall in. The partitions ahead are
        # store/partitions.py's, made right after the migrations (migrate.upgrade)
        # as wide as the record retention calls for: made here, a month would
        # cover the present whatever the retention.
        held = op.get_bind().execute(
            sa.text(
                "SELECT DISTINCT extract(year FROM at AT TIME ZONE 'UTC')::int, "
                "extract(month FROM at AT TIME ZONE 'UTC')::int FROM observations "
                "WHERE detail IS NOT NULL AND jsonb_typeof(detail) <> 'null'"
            )
        )
        for year, month in sorted({(row[0], row[1]) for row in held}):
            op.execute(_month_partition(year, month))
    # A detail-less answer was stored as JSON null, a reaped one as SQL NULL:
    # neither is an answer to keep.
    json_type = "jsonb_typeof" if postgres else "json_type"
    op.execute(
        "INSERT INTO observation_details (observation_id, retention_bucket, detail) "
        "SELECT id, at, detail FROM observations "
        f"WHERE detail IS NOT NULL AND {json_type}(detail) <> 'null'"
    )
    with op.batch_alter_table("observations", schema=None) as batch_op:
        batch_op.drop_column("detail")


def downgrade() -> None:
    with op.batch_alter_table("observations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("detail", _json(), nullable=True))
    # What retention removed stays removed (SQL NULL, as a reaped answer was).
    op.execute(
        "UPDATE observations SET detail = (SELECT d.detail FROM observation_details AS d "
        "WHERE d.observation_id = observations.id) "
        "WHERE id IN (SELECT observation_id FROM observation_details)"
    )
    # On PostgreSQL its partitions go with it.
    op.drop_table("observation_details")
