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
as every distinct key their attempts sent, plus a new key a decision approved
that is not sent yet: conservative, as a key no answer proved unexecuted may
have executed. Each mandate's `reserved` takes the
difference between its payments' shares by the old rule and by the new one,
so the books stay the sum of the shares; the downgrade gives it back.
"""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa
from alembic import op

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


# The rules written out as they stood on each side of this revision, so that a
# later change to the domain's books cannot change what this migration moves.
_FINAL = ("OUTCOME_KNOWN", "CANCELLED")
_WATCHED = ("watching", "provider_not_final")


def _executions(row: Any) -> int:
    references = row["executed_references"]
    if isinstance(references, str):  # a plain read hands SQLite's JSON back as text
        references = json.loads(references)
    known = set(references or ())
    succeeded = row["outcome"] == "succeeded"
    if succeeded and row["provider_reference"]:
        known.add(row["provider_reference"])
    return max(len(known), 1 if succeeded and row["state"] == "OUTCOME_KNOWN" else 0)


def _reserved_before(row: Any) -> int:
    """0016's rule: the amount while unresolved with nothing executed."""
    unresolved = row["state"] not in _FINAL
    return int(row["amount"]) if unresolved and _executions(row) == 0 else 0


def _reserved_from_here(row: Any) -> int:
    """0017's rule: once per live key while unresolved or watched."""
    count, keys = _executions(row), int(row["live_keys"])
    if row["state"] not in _FINAL:
        held = max(count, keys, 1)
    elif row["watch"] in _WATCHED:
        held = max(count, keys)
    else:
        held = count
    return int(row["amount"]) * (held - count)


def _reserved_moves(bind: Any, sign: int) -> None:
    """Move each mandate's `reserved` by its payments' shares by this revision's
    rule less those by the one before (sign 1), or back (sign -1)."""
    moves: dict[str, int] = {}
    for row in bind.execute(sa.text(_UNRESOLVED_OR_WATCHED)).mappings():
        delta = _reserved_from_here(row) - _reserved_before(row)
        if delta:
            moves[row["mandate_id"]] = moves.get(row["mandate_id"], 0) + sign * delta
    for mandate_id, delta in moves.items():
        bind.execute(
            sa.text("UPDATE mandates SET reserved = reserved + :delta WHERE mandate_id = :id"),
            {"delta": delta, "id": mandate_id},
        )


def _authorised_keys(bind: Any) -> None:
    """A key a decision authorised and no attempt has sent yet (an approved new
    request waiting for the dispatcher) is live too: one more each."""
    waiting = bind.execute(
        sa.text("SELECT operation_id FROM operations WHERE next_action = 'resubmit'")
    ).all()
    for (operation_id,) in waiting:
        latest = bind.execute(
            sa.text(
                "SELECT inputs FROM decisions WHERE operation_id = :id AND next_action = 'resubmit'"
                " AND id = (SELECT max(id) FROM decisions WHERE operation_id = :id)"
            ),
            {"id": operation_id},
        ).first()
        if latest is None:
            continue
        inputs = json.loads(latest[0]) if isinstance(latest[0], str) else latest[0]
        sent = bind.execute(
            sa.text(
                "SELECT 1 FROM attempts"
                " WHERE operation_id = :id AND provider_idempotency_key = :key"
            ),
            {"id": operation_id, "key": inputs.get("provider_idempotency_key")},
        ).first()
        if sent is None:
            bind.execute(
                sa.text("UPDATE operations SET live_keys = live_keys + 1 WHERE operation_id = :id"),
                {"id": operation_id},
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
    _authorised_keys(op.get_bind())
    _reserved_moves(op.get_bind(), 1)


def downgrade() -> None:
    _reserved_moves(op.get_bind(), -1)
    op.drop_column("operations", "live_keys")
    op.drop_column("operations", "watch")
