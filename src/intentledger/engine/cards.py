"""Card intents: issuing a card, freezing and unfreezing it.

A card's projection changes only with its operations: it becomes
`indeterminate` when an operation on it is accepted, and known again when that
operation's outcome is (by the provider's answer, a reconciliation read, or an
operator). One operation at a time per card keeps each read unambiguous.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from intentledger.domain.cards import ACTION_FROM
from intentledger.engine import changes
from intentledger.engine.intake import Prepare
from intentledger.engine.refusal import Refusal
from intentledger.store.ledger import Ledger


def new_card_id() -> str:
    return "crd_" + secrets.token_hex(12)


def prepare_issue(card_id: str, label: str | None) -> Prepare:
    async def prepare(ledger: Ledger, now: datetime, values: dict[str, Any]) -> None:
        await ledger.insert_card(
            card_id=card_id,
            actor=values["actor"],
            label=label,
            provider_card_id=None,
            status="pending",
            indeterminate=True,
            pending_operation_id=values["operation_id"],
            version=1,
            created_at=now,
            updated_at=now,
        )
        values["request_context"]["card_id"] = card_id

    return prepare


def prepare_action(card_id: str, kind: str) -> Prepare:
    async def prepare(ledger: Ledger, now: datetime, values: dict[str, Any]) -> None:
        card = await ledger.get_card(card_id, for_update=True)
        if card is None or card.actor != values["actor"]:
            raise Refusal(404, "card-not-found", f"no card {card_id!r}")
        if card.pending_operation_id is not None:
            raise Refusal(
                409,
                "card-busy",
                f"card {card_id} has an operation in flight ({card.pending_operation_id})",
            )
        needed = ACTION_FROM[kind]
        if card.status != needed or card.provider_card_id is None:
            verb = kind.removeprefix("card_")
            raise Refusal(409, "card-state", f"cannot {verb} card {card_id}: it is {card.status}")
        await changes.change_card(
            ledger, card_id, now, indeterminate=True, pending_operation_id=values["operation_id"]
        )
        values["request_context"]["card_id"] = card_id
        values["request_context"]["provider_card_id"] = card.provider_card_id

    return prepare
