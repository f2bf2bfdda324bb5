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
