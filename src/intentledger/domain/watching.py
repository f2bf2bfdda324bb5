"""When watching ends, and what money is held meanwhile. Pure.

An operation that sent more than one provider key, or that a person resolved,
is watched after it settles: the provider is asked again (the verification
look, or audit) until it is *quiet* — every object it shows under any of the
operation's keys is in a final state, and the look was taken after every
key's last send plus the lookup's declared lag. A look that shows an object
still open (processing, pending, requires_*, a word the adapter does not map)
or that falls inside the lag is not the end: another look is scheduled. A
budget of looks (AUDIT_LOOKS) that runs out while something is open is not
absence either: a person is told (`provider_not_final`) and the looks go on at
the capped backoff until the provider is quiet.

Money follows the same rule. An operation holds its amount once per provider
key that was sent (or authorised to be sent) and is not proven final and not
executed — its *live keys* — for as long as it is unresolved or watched:

    unresolved:           max(executions, live keys, 1)
    settled, watched:     max(executions, live keys)
    settled, quiet:       executions

`executions` is every executed provider object the evidence showed (at least
one for a settled success). A person's "failed" therefore frees nothing while
the provider may still execute; the end of watching does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from intentledger.domain.states import FINAL, NextAction, State


class Watch(StrEnum):
    """`operations.watch`: where watching a settled operation stands (NULL: it
    never needed watching)."""

    WATCHING = "watching"  # verification looks are scheduled
    # The looks' budget ran out while the provider still showed something open:
    # a person is told (work queue), and the looks go on at the capped backoff.
    NOT_FINAL = "provider_not_final"
    QUIET = "quiet"  # ended: the provider was quiet at the last look


WATCHED = frozenset({Watch.WATCHING, Watch.NOT_FINAL})


def is_watched(watch: str | None) -> bool:
    return watch is not None and Watch(watch) in WATCHED


@dataclass(frozen=True)
class Look:
    """What one look at the provider shows, for the question "is it quiet?"."""

    # The look had an answer that speaks for everything it was asked about
    # (a failed, unreadable or incomplete lookup does not).
    answered: bool
    # Objects in a state that is not final (the adapter's words).
    open: frozenset[str]
    # The lookup's declared lag (None: strongly consistent).
    lag: timedelta | None
    # A submit of the operation is still in flight (its outbox row not done):
    # its write may land after this look, whatever the lookup's consistency.
    submit_in_flight: bool = False


def not_quiet(look: Look, last_sent_at: datetime | None, now: datetime) -> str | None:
    """Why the provider cannot be called quiet after this look (None: it is)."""
    if not look.answered:
        return "the look had no complete answer"
    if look.submit_in_flight:
        return "a submit of the operation is still in flight"
    if look.open:
        return f"{', '.join(sorted(look.open))} not final"
    if look.lag is not None and last_sent_at is not None and now < last_sent_at + look.lag:
        return (
            f"looked inside the lookup's lag ({look.lag}) of the last send: "
            f"quiet no earlier than {(last_sent_at + look.lag).isoformat()}"
        )
    return None


def settled_next_action(duplicate: bool, contradicted: bool, watch: str | None) -> NextAction:
    """What a settled operation waits for: a person while a flag is up or the
    provider is still not final past the budget of looks (the work queue's
    index admits it by `next_action`), nothing otherwise."""
    if duplicate or contradicted or watch == Watch.NOT_FINAL:
        return NextAction.OPERATOR
    return NextAction.NONE


def held(state: State, executions: int, live_keys: int, watched: bool) -> int:
    """How many times the operation's amount is held (spent or reserved)."""
    if state not in FINAL:
        return max(executions, live_keys, 1)
    if watched:
        return max(executions, live_keys)
    return executions


__all__ = [
    "WATCHED",
    "Look",
    "Watch",
    "held",
    "is_watched",
    "not_quiet",
    "settled_next_action",
]
