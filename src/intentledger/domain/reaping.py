"""Which settled operations' bulky rows may be removed (docs/decisions/0018).

Past the record retention, an operation's provider answers (observation
details), request body and done outbox rows are cost, not evidence — unless a
person or the provider may still need them. So an operation is reaped only when
it is settled (OUTCOME_KNOWN or CANCELLED), carries no flag a person must clear,
has no open refund (not final, or with outbox work left: a person's "failed"
the audit has not checked still holds its money; or flagged: a person must
look at it, and at its payment with it), is not a refund of a flagged
payment, has no outbox work still to do (an audit look after a person's
resolution), was last changed before the cutoff, and was not reaped already.
store/reaping.py asks the same in SQL; a test holds the two to the same answer.

On PostgreSQL the provider answers are not removed when their operation is
reaped but when the partition they lie in (a month, or less for a short
retention: domain/widths.py) passes the retention: reaping stamps the
operation with the last of its observations, and the drop takes the answers
up to that one with it. Every other answer in the partition is moved out
first (`outlives_its_partition`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from intentledger.domain.states import FINAL, State

DEFAULT_RECORD_RETENTION = timedelta(days=400)


@dataclass(frozen=True)
class ReapFacts:
    state: State
    duplicate_detected: bool
    outcome_contradicted: bool
    updated_at: datetime
    # Refunds of this operation not final, with outbox work left, or flagged.
    open_refunds: int
    # Outbox rows of this operation not yet done.
    pending_outbox: int
    reaped: bool
    # A refund whose payment carries a flag (a duplicate, a contradiction).
    parent_flagged: bool = False


def may_reap(facts: ReapFacts, cutoff: datetime) -> bool:
    return (
        facts.state in FINAL
        and not facts.duplicate_detected
        and not facts.outcome_contradicted
        and facts.open_refunds == 0
        and not facts.parent_flagged
        and facts.pending_outbox == 0
        and facts.updated_at <= cutoff
        and not facts.reaped
    )


def outlives_its_partition(reaped_through: int | None, observation_id: int) -> bool:
    """Whether a provider answer must be kept when its partition is
    dropped: unless its operation's reap gave it up, it is.

    Reaping decided, under the operation's lock, that no one may still need
    the answers it had (may_reap), and recorded the highest id among its
    observations (`reaped_through`); that verdict is never taken back. An
    operation not reaped yet may still be needed (or not yet be looked at), and
    an answer written after the reap is kept, as on SQLite, where reaping
    deletes the answers there are when it runs. "After" is told by the id, not
    by the instant: every answer is written under its operation's lock, so one
    written after the reap committed has a higher id, whereas its instant was
    read from a clock before the writer waited for that lock, maybe on another
    machine, and may be earlier than the reap's. So the drop follows decisions
    already made and final, and a refund, a flag or late evidence that comes
    while a partition is being dropped changes nothing it relies on.
    """
    return reaped_through is None or observation_id > reaped_through
