"""Beneficiaries, cards, card actions and refunds: the sandbox's truth beyond charges.

Rows, and the SQL that reads and writes them. Every writer takes a connection already inside
the store's write transaction, so the key check, the write and the kept answer commit
together or not at all.
"""

from __future__ import annotations

import secrets
import sqlite3
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from intentledger.providers.sandbox.rows import (
    JSONObject,
    format_timestamp,
    parse_timestamp,
    where_equal,
)

CardStatus = Literal["active", "frozen"]
CardActionName = Literal["freeze", "unfreeze"]

STATUS_AFTER: dict[CardActionName, CardStatus] = {"freeze": "frozen", "unfreeze": "active"}

SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS beneficiaries (
        id TEXT PRIMARY KEY,
        reference TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        name TEXT NOT NULL,
        iban TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS beneficiaries_by_reference ON beneficiaries (reference)",
    """
    CREATE TABLE IF NOT EXISTS cards (
        id TEXT PRIMARY KEY,
        reference TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        label TEXT,
        status TEXT NOT NULL CHECK (status IN ('active', 'frozen')),
        created_at TEXT NOT NULL,
        updated_at TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS cards_by_reference ON cards (reference)",
    """
    CREATE TABLE IF NOT EXISTS card_actions (
        id TEXT PRIMARY KEY,
        card_id TEXT NOT NULL REFERENCES cards (id),
        action TEXT NOT NULL CHECK (action IN ('freeze', 'unfreeze')),
        reference TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        executed_at TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS card_actions_by_card ON card_actions (card_id)",
    "CREATE INDEX IF NOT EXISTS card_actions_by_reference ON card_actions (reference)",
    # Like localstripe, the sandbox never refuses a refund for exceeding its
    # charge: the ledger's own guard is what the tests prove.
    """
    CREATE TABLE IF NOT EXISTS refunds (
        id TEXT PRIMARY KEY,
        charge_id TEXT NOT NULL REFERENCES charges (id),
        reference TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        amount INTEGER NOT NULL,
        reason TEXT,
        status TEXT NOT NULL,
        created_at TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS refunds_by_reference ON refunds (reference)",
    "CREATE INDEX IF NOT EXISTS refunds_by_charge ON refunds (charge_id)",
)


# -- well-formed writes, reduced to what the store needs to decide and record them -----------


@dataclass(frozen=True)
class BeneficiaryRequest:
    reference: str
    idempotency_key: str
    name: str
    iban: str
    fingerprint: str


@dataclass(frozen=True)
class CardRequest:
    reference: str
    idempotency_key: str
    label: str | None
    fingerprint: str


@dataclass(frozen=True)
class CardActionRequest:
    card_id: str
    action: CardActionName
    reference: str
    idempotency_key: str
    fingerprint: str


@dataclass(frozen=True)
class RefundRequest:
    charge_id: str
    reference: str
    idempotency_key: str
    amount: int
    reason: str | None
    fingerprint: str


# -- rows -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Beneficiary:
    id: str
    reference: str
    idempotency_key: str
    name: str
    iban: str
    status: str
    created_at: datetime

    def as_provider_response(self) -> JSONObject:
        return {
            "id": self.id,
            "reference": self.reference,
            "name": self.name,
            "iban": self.iban,
            "status": self.status,
            "created_at": format_timestamp(self.created_at),
        }

    def as_truth_entry(self) -> JSONObject:
        return {**self.as_provider_response(), "idempotency_key": self.idempotency_key}


@dataclass(frozen=True)
class Card:
    id: str
    reference: str
    idempotency_key: str
    label: str | None
    status: CardStatus
    created_at: datetime
    updated_at: datetime

    def as_provider_response(self) -> JSONObject:
        return {
            "id": self.id,
            "reference": self.reference,
            "label": self.label,
            "status": self.status,
            "created_at": format_timestamp(self.created_at),
            "updated_at": format_timestamp(self.updated_at),
        }

    def as_truth_entry(self) -> JSONObject:
        # The key that issued the card; actions on it carry their own keys.
        return {**self.as_provider_response(), "idempotency_key": self.idempotency_key}


@dataclass(frozen=True)
class CardAction:
    id: str
    card_id: str
    action: CardActionName
    reference: str
    idempotency_key: str
    executed_at: datetime

    def as_truth_entry(self) -> JSONObject:
        return {
            "id": self.id,
            "card_id": self.card_id,
            "action": self.action,
            "reference": self.reference,
            "idempotency_key": self.idempotency_key,
            "executed_at": format_timestamp(self.executed_at),
        }


@dataclass(frozen=True)
class Refund:
    id: str
    charge_id: str
    reference: str
    idempotency_key: str
    amount: int
    reason: str | None
    status: str
    created_at: datetime

    def as_provider_response(self) -> JSONObject:
        return {
            "id": self.id,
            "charge": self.charge_id,
            "reference": self.reference,
            "amount": self.amount,
            "reason": self.reason,
            "status": self.status,
            "created_at": format_timestamp(self.created_at),
        }

    def as_truth_entry(self) -> JSONObject:
        return {**self.as_provider_response(), "idempotency_key": self.idempotency_key}


# -- writes (inside the store's transaction) --------------------------------------------------


def insert_beneficiary(
    conn: sqlite3.Connection, request: BeneficiaryRequest, now: datetime
) -> Beneficiary:
    beneficiary = Beneficiary(
        id="ba_" + secrets.token_hex(12),
        reference=request.reference,
        idempotency_key=request.idempotency_key,
        name=request.name,
        iban=request.iban,
        status="active",
        created_at=now,
    )
    conn.execute(
        "INSERT INTO beneficiaries"
        " (id, reference, idempotency_key, name, iban, status, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            beneficiary.id,
            beneficiary.reference,
            beneficiary.idempotency_key,
            beneficiary.name,
            beneficiary.iban,
            beneficiary.status,
            format_timestamp(beneficiary.created_at),
        ),
    )
    return beneficiary


def insert_card(conn: sqlite3.Connection, request: CardRequest, now: datetime) -> Card:
    card = Card(
        id="card_" + secrets.token_hex(12),
        reference=request.reference,
        idempotency_key=request.idempotency_key,
        label=request.label,
        status="active",
        created_at=now,
        updated_at=now,
    )
    conn.execute(
        "INSERT INTO cards"
        " (id, reference, idempotency_key, label, status, created_at, updated_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            card.id,
            card.reference,
            card.idempotency_key,
            card.label,
            card.status,
            format_timestamp(card.created_at),
            format_timestamp(card.updated_at),
        ),
    )
    return card


def apply_card_action(conn: sqlite3.Connection, request: CardActionRequest, now: datetime) -> Card:
    """Set the card's status and record the action; the caller has checked the card exists.

    Freezing a frozen card still records an action: the truth counts executions, so a test can
    tell a replay (no row) from a second execution (a row), whatever the status did.
    """
    stamp = format_timestamp(now)
    conn.execute(
        "UPDATE cards SET status = ?, updated_at = ? WHERE id = ?",
        (STATUS_AFTER[request.action], stamp, request.card_id),
    )
    conn.execute(
        "INSERT INTO card_actions"
        " (id, card_id, action, reference, idempotency_key, executed_at)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (
            "ca_" + secrets.token_hex(12),
            request.card_id,
            request.action,
            request.reference,
            request.idempotency_key,
            stamp,
        ),
    )
    card = find_card(conn, request.card_id)
    assert card is not None  # updated above, in this transaction
    return card


def insert_refund(conn: sqlite3.Connection, request: RefundRequest, now: datetime) -> Refund:
    refund = Refund(
        id="re_" + secrets.token_hex(12),
        charge_id=request.charge_id,
        reference=request.reference,
        idempotency_key=request.idempotency_key,
        amount=request.amount,
        reason=request.reason,
        status="succeeded",
        created_at=now,
    )
    conn.execute(
        "INSERT INTO refunds"
        " (id, charge_id, reference, idempotency_key, amount, reason, status, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (
            refund.id,
            refund.charge_id,
            refund.reference,
            refund.idempotency_key,
            refund.amount,
            refund.reason,
            refund.status,
            format_timestamp(refund.created_at),
        ),
    )
    return refund


def charge_exists(conn: sqlite3.Connection, charge_id: str) -> bool:
    row = conn.execute("SELECT 1 FROM charges WHERE id = ?", (charge_id,)).fetchone()
    return row is not None


# -- reads ------------------------------------------------------------------------------------


def find_card(conn: sqlite3.Connection, card_id: str) -> Card | None:
    row = conn.execute("SELECT * FROM cards WHERE id = ?", (card_id,)).fetchone()
    return None if row is None else _card_from_row(row)


def select_beneficiaries(conn: sqlite3.Connection, reference: str | None) -> list[Beneficiary]:
    where, params = where_equal(reference=reference)
    rows = conn.execute(
        f"SELECT * FROM beneficiaries{where} ORDER BY created_at, rowid", params
    ).fetchall()
    return [_beneficiary_from_row(row) for row in rows]


def select_cards(conn: sqlite3.Connection, reference: str | None) -> list[Card]:
    where, params = where_equal(reference=reference)
    rows = conn.execute(f"SELECT * FROM cards{where} ORDER BY created_at, rowid", params)
    return [_card_from_row(row) for row in rows.fetchall()]


def select_card_actions(
    conn: sqlite3.Connection, reference: str | None, card_id: str | None
) -> list[CardAction]:
    where, params = where_equal(reference=reference, card_id=card_id)
    rows = conn.execute(f"SELECT * FROM card_actions{where} ORDER BY executed_at, rowid", params)
    return [_card_action_from_row(row) for row in rows.fetchall()]


def select_refunds(
    conn: sqlite3.Connection, reference: str | None, charge_id: str | None = None
) -> list[Refund]:
    where, params = where_equal(reference=reference, charge_id=charge_id)
    rows = conn.execute(f"SELECT * FROM refunds{where} ORDER BY created_at, rowid", params)
    return [_refund_from_row(row) for row in rows.fetchall()]


def _refund_from_row(row: sqlite3.Row) -> Refund:
    return Refund(
        id=row["id"],
        charge_id=row["charge_id"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        amount=row["amount"],
        reason=row["reason"],
        status=row["status"],
        created_at=parse_timestamp(row["created_at"]),
    )


def _beneficiary_from_row(row: sqlite3.Row) -> Beneficiary:
    return Beneficiary(
        id=row["id"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        name=row["name"],
        iban=row["iban"],
        status=row["status"],
        created_at=parse_timestamp(row["created_at"]),
    )


def _card_from_row(row: sqlite3.Row) -> Card:
    return Card(
        id=row["id"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        label=row["label"],
        status=row["status"],
        created_at=parse_timestamp(row["created_at"]),
        updated_at=parse_timestamp(row["updated_at"]),
    )


def _card_action_from_row(row: sqlite3.Row) -> CardAction:
    return CardAction(
        id=row["id"],
        card_id=row["card_id"],
        action=row["action"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        executed_at=parse_timestamp(row["executed_at"]),
    )
