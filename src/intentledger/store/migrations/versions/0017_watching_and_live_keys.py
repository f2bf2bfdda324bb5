"""watching ends only when the provider is quiet: operations.watch and operations.live_keys

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03

`watch` says where watching a settled operation stands (domain/watching.py:
NULL never watched, `watching`, `provider_not_final`, `quiet`); `live_keys`
counts the provider keys that may still execute, as the last evidence left
them. A payment's mandate share holds its amount once per live key while it is
unresolved or watched (domain/evidence.mandate_share).

Operations with a verification look still due are watched from this revision
on, and their live keys (and those of every unresolved operation) are counted
as every distinct key their attempts sent: conservative, as a key no answer
proved unexecuted may have executed. Each mandate's `reserved` takes the
difference between its payments' shares by the old rule and by the new one,
so the books stay the sum of the shares; the downgrade gives it back.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

from intentledger.domain.evidence import mandate_share, recorded_executions
from intentledger.domain.states import Outcome, State
from intentledger.domain.watching import is_watched

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_UNRESOLVED_OR_WATCHED = """
    SELECT o.operation_id, o.mandate_id, o.amount, o.state, o.outcome,
           o.executed_references, o.provider_reference, o.watch, o.live_keys
    FROM operations AS o
    WHERE o.mandate_id IS NOT NULL AND o.kind = 'payment'
      AND (o.watch IS NOT NULL OR o.state NOT IN ('OUTCOME_KNOWN', 'CANCELLED'))
"""


def _reserved_moves(bind: Any, sign: int) -> None:
    """Move each mandate's `reserved` by its payments' new shares less their old
    ones (sign 1), or back (sign -1)."""
    moves: dict[str, int] = {}
    for row in bind.execute(sa.text(_UNRESOLVED_OR_WATCHED)).mappings():
        references = row["executed_references"]
        if isinstance(references, str):  # a plain read hands SQLite's JSON back as text
            references = json.loads(references)
        state = State(row["state"])
        outcome = Outcome(row["outcome"]) if row["outcome"] else None
        executed = recorded_executions(references, row["outcome"], row["provider_reference"])
        old = mandate_share(row["amount"], state, outcome, executed)
        new = mandate_share(
            row["amount"],
            state,
            outcome,
            executed,
            keys=row["live_keys"],
            watched=is_watched(row["watch"]),
        )
        delta = new.reserved - old.reserved
        if delta:
            moves[row["mandate_id"]] = moves.get(row["mandate_id"], 0) + sign * delta
    for mandate_id, delta in moves.items():
        bind.execute(
            sa.text("UPDATE mandates SET reserved = reserved + :delta WHERE mandate_id = :id"),
            {"delta": delta, "id": mandate_id},
        )


# Plain ALTER TABLE on both databases, as in 0016: a batch operation would
# rebuild `operations` on SQLite, which the foreign keys that point at it refuse.


def upgrade() -> None:
    op.add_column("operations", sa.Column("watch", sa.String(24), nullable=True))
    op.add_column(
        "operations",
        sa.Column("live_keys", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )
    op.execute(
        """
        UPDATE operations SET watch = 'watching'
        WHERE EXISTS (SELECT 1 FROM outbox AS b WHERE b.operation_id = operations.operation_id
                      AND b.kind = 'audit' AND b.done_at IS NULL)
        """
    )
    op.execute(
        """
        UPDATE operations SET live_keys = (
            SELECT count(DISTINCT a.provider_idempotency_key) FROM attempts AS a
            WHERE a.operation_id = operations.operation_id)
        WHERE watch IS NOT NULL OR state NOT IN ('OUTCOME_KNOWN', 'CANCELLED')
        """
    )
    _reserved_moves(op.get_bind(), 1)


def downgrade() -> None:
    _reserved_moves(op.get_bind(), -1)
    op.drop_column("operations", "live_keys")
    op.drop_column("operations", "watch")
