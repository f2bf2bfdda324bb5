"""Mandates: their statuses, what each status change may start from, and what a
payment under a mandate may reserve. Pure.

A payment reserves its amount at intake; the mandate's books then move as the
payment's share moves (domain/evidence.py, mandate_share). What is free is what
neither a reservation nor a spent payment holds:

    free = total_limit - reserved - spent

A payment fits when it is in the mandate's currency, at most `max_amount`, and
at most what is free; only an active mandate takes new payments or lets one be
sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class MandateStatus(StrEnum):
    # The database stores these strings.
    ACTIVE = "active"
    SUSPENDED = "suspended"
    REVOKED = "revoked"


MandateAction = Literal["suspend", "resume", "revoke"]

# Which statuses each action may start from, and where it leads.
STATUS_CHANGES: dict[MandateAction, tuple[frozenset[MandateStatus], MandateStatus]] = {
    "suspend": (frozenset({MandateStatus.ACTIVE}), MandateStatus.SUSPENDED),
    "resume": (frozenset({MandateStatus.SUSPENDED}), MandateStatus.ACTIVE),
    "revoke": (frozenset({MandateStatus.ACTIVE, MandateStatus.SUSPENDED}), MandateStatus.REVOKED),
}

# What a missing mandate reads as where its status is reported.
MISSING = "missing"


def is_active(status: str | None) -> bool:
    """Does a mandate in `status` (None: no such mandate) take and send payments?"""
    return status == MandateStatus.ACTIVE


def status_after(action: MandateAction, status: str) -> MandateStatus | None:
    """Where `action` leads from `status`, or None when it may not start there."""
    allowed_from, target = STATUS_CHANGES[action]
    return target if status in allowed_from else None


def cancels_unsubmitted(status: MandateStatus) -> bool:
    """Does a mandate entering `status` cancel its payments not yet submitted?"""
    return not is_active(status)


def unheld(total_limit: int, reserved: int, spent: int) -> int:
    """What of the total limit neither a reservation nor a spent payment holds."""
    return total_limit - reserved - spent


@dataclass(frozen=True)
class Books:
    """What the reserve rules need of a mandate."""

    currency: str
    max_amount: int
    total_limit: int
    reserved: int
    spent: int

    @property
    def free(self) -> int:
        return unheld(self.total_limit, self.reserved, self.spent)


@dataclass(frozen=True)
class ReserveRefused:
    """Why a payment may not reserve under the mandate: a problem type and its detail."""

    status: int
    code: str
    detail: str


def reserve_refusal(
    mandate_id: str, status: str, books: Books, amount: int, currency: str
) -> ReserveRefused | None:
    """Why a payment of `amount` in `currency` may not reserve under this mandate
    (None: it may, and `reserved` grows by `amount`)."""
    if not is_active(status):
        return ReserveRefused(409, "mandate-not-active", f"mandate {mandate_id} is {status}")
    if currency != books.currency:
        return ReserveRefused(
            422,
            "mandate-currency",
            f"mandate {mandate_id} is in {books.currency}, not {currency}",
        )
    if amount > books.max_amount:
        return ReserveRefused(
            422,
            "mandate-max-amount",
            f"{amount} exceeds the mandate's max_amount of {books.max_amount} per payment",
        )
    if amount > books.free:
        return ReserveRefused(
            422,
            "mandate-limit",
            f"{amount} exceeds what remains of the mandate's total_limit ({books.free})",
        )
    return None


__all__ = [
    "MISSING",
    "STATUS_CHANGES",
    "Books",
    "MandateAction",
    "MandateStatus",
    "ReserveRefused",
    "cancels_unsubmitted",
    "is_active",
    "reserve_refusal",
    "status_after",
    "unheld",
]
