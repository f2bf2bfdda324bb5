"""record retention: operations.reaped_through_observation, the last answer a reap gave up

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03

Dropping a partition of provider answers keeps every answer its operation's
reap did not give up (domain/reaping.outlives_its_partition). That was told by
time, `observations.at` against `operations.reaped_at`; but a writer reads its
clock before it waits for the operation's lock, the reaper reads its own
before it locks, and the two may run on machines whose clocks differ, so an
answer written after a reap could carry an earlier instant and go with its
partition. It is now told by the observation's id: the reap records the
highest id of the operation's observations, read under the operation's lock,
and every answer is written under that lock, so one written after the reap
has a higher id. Operations reaped before this revision get the highest id
their reap could have seen by the old rule (answers at or before `reaped_at`;
0 for none).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


# Plain ALTER TABLE on both databases (SQLite 3.35 and later drop a column in
# place): a batch operation would rebuild `operations` on SQLite, which the
# foreign keys that point at it refuse.


def upgrade() -> None:
    # The type of observations.id.
    op.add_column(
        "operations", sa.Column("reaped_through_observation", sa.Integer(), nullable=True)
    )
    op.execute(
        """
        UPDATE operations SET reaped_through_observation = COALESCE(
            (SELECT max(o.id) FROM observations AS o
             WHERE o.operation_id = operations.operation_id AND o.at <= operations.reaped_at),
            0)
        WHERE reaped_at IS NOT NULL
        """
    )


def downgrade() -> None:
    op.drop_column("operations", "reaped_through_observation")
