"""Card projections: what a card shows once an operation on it has an outcome.

While an operation on a card has no known outcome, the card is
`indeterminate`: its last known status is shown, flagged as possibly stale.
"""

from __future__ import annotations

CARD_KINDS = frozenset({"card_issue", "card_freeze", "card_unfreeze"})
# The card status each action needs before it may be sent, and leaves after success.
ACTION_FROM = {"card_freeze": "active", "card_unfreeze": "frozen"}
ACTION_TO = {"card_freeze": "frozen", "card_unfreeze": "active"}


def status_after(kind: str, succeeded: bool, current: str) -> str:
    if kind == "card_issue":
        return "active" if succeeded else "not_issued"
    return ACTION_TO[kind] if succeeded else current


def settled_projection(
    kind: str, succeeded: bool, current: str, provider_reference: str | None
) -> dict[str, object]:
    """The card's projection once an operation on it settles: out of
    `indeterminate` with the operation's outcome, and an issued card with the
    provider's id."""
    projection: dict[str, object] = {
        "status": status_after(kind, succeeded, current),
        "indeterminate": False,
        "pending_operation_id": None,
    }
    if kind == "card_issue" and succeeded:
        projection["provider_card_id"] = provider_reference
    return projection


def adopted_card_id(kind: str, known: str | None, named: str | None) -> str | None:
    """The provider's card id a settled issue takes from later evidence: only a
    card settled without one (a person's word) takes it, and never replaces one."""
    if kind == "card_issue" and known is None and named:
        return named
    return None
