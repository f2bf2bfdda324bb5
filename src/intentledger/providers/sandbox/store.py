"""The sandbox provider's own truth: every charge it executed, every key it honours, every
request it received.

It lives in one SQLite file so that any number of OS processes mounting the sandbox share a
single truth, and so that the truth survives a restart. Calls block; callers run them in a
worker thread. Each call opens its own connection because sqlite3 connections must not be
shared across threads.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

JSONObject = dict[str, Any]
RequestKind = Literal["submit", "lookup"]

BUSY_TIMEOUT_SECONDS = 30.0

_SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS charges (
        id TEXT PRIMARY KEY,
        reference TEXT NOT NULL,
        idempotency_key TEXT NOT NULL,
        amount INTEGER NOT NULL,
        currency TEXT NOT NULL,
        payment_method TEXT NOT NULL,
        executed_at TEXT NOT NULL
    )
    """,
    "CREATE INDEX IF NOT EXISTS charges_by_reference ON charges (reference)",
    """
    CREATE TABLE IF NOT EXISTS idempotency_keys (
        key TEXT PRIMARY KEY,
        first_used_at TEXT NOT NULL,
        request_fingerprint TEXT NOT NULL,
        response_status INTEGER NOT NULL,
        response_body TEXT NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS requests (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        kind TEXT NOT NULL CHECK (kind IN ('submit', 'lookup')),
        reference TEXT,
        idempotency_key TEXT,
        payment_method TEXT,
        received_at TEXT NOT NULL,
        response_status INTEGER
    )
    """,
    "CREATE INDEX IF NOT EXISTS requests_by_reference ON requests (reference, kind)",
)


def format_timestamp(moment: datetime) -> str:
    # A fixed-width form (always microseconds, always Z) so that text order is time order
    # and ORDER BY executed_at is correct without parsing.
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text).astimezone(UTC)


@dataclass(frozen=True)
class StoredResponse:
    """A final answer, kept against its idempotency key so a retry replays it."""

    status: int
    body: JSONObject


@dataclass(frozen=True)
class ChargeRequest:
    """A well-formed submit, reduced to what the store needs to decide and record it."""

    reference: str
    idempotency_key: str
    amount: int
    currency: str
    payment_method: str
    fingerprint: str


@dataclass(frozen=True)
class Charge:
    id: str
    reference: str
    idempotency_key: str
    amount: int
    currency: str
    payment_method: str
    executed_at: datetime

    def as_provider_response(self) -> JSONObject:
        """What the provider answers to the submit that executed this charge."""
        return {
            "id": self.id,
            "reference": self.reference,
            "status": "succeeded",
            "amount": self.amount,
            "currency": self.currency,
            "executed_at": format_timestamp(self.executed_at),
        }

    def as_lookup_entry(self) -> JSONObject:
        return {**self.as_provider_response(), "idempotency_key": self.idempotency_key}

    def as_truth_entry(self) -> JSONObject:
        return {
            "id": self.id,
            "reference": self.reference,
            "idempotency_key": self.idempotency_key,
            "amount": self.amount,
            "currency": self.currency,
            "executed_at": format_timestamp(self.executed_at),
        }


@dataclass(frozen=True)
class RequestRecord:
    id: int
    kind: RequestKind
    reference: str | None
    idempotency_key: str | None
    payment_method: str | None
    received_at: datetime
    response_status: int | None

    def as_entry(self) -> JSONObject:
        return {
            "id": self.id,
            "kind": self.kind,
            "reference": self.reference,
            "idempotency_key": self.idempotency_key,
            "payment_method": self.payment_method,
            "received_at": format_timestamp(self.received_at),
            "response_status": self.response_status,
        }


# What a fresh (non-replayed) submit does to the truth, decided inside the transaction.


@dataclass(frozen=True)
class ExecuteCharge:
    """Move the money and keep the 200 against the key."""


@dataclass(frozen=True)
class StoreRefusal:
    """A final answer that moved no money (a decline); kept against the key like Stripe does."""

    response: StoredResponse


@dataclass(frozen=True)
class LeaveUnexecuted:
    """Nothing moved and nothing is kept, so a retry with the same key runs afresh."""


Effect = ExecuteCharge | StoreRefusal | LeaveUnexecuted


# What the submit transaction found and did.


@dataclass(frozen=True)
class Replayed:
    response: StoredResponse


@dataclass(frozen=True)
class KeyReused:
    """The key is live but was first used with a different request body."""


@dataclass(frozen=True)
class Processed:
    first_attempt: bool
    response: StoredResponse | None


SubmitOutcome = Replayed | KeyReused | Processed


class SandboxStore:
    def __init__(self, database_path: str, key_retention: timedelta) -> None:
        self._path = database_path
        self._key_retention = key_retention
        self._schema_ready = False
        self._schema_lock = threading.Lock()

    # -- writes ---------------------------------------------------------------------------

    def log_request(
        self,
        kind: RequestKind,
        reference: str | None,
        idempotency_key: str | None,
        payment_method: str | None,
        received_at: datetime,
    ) -> int:
        with self._connection() as conn:
            cursor = conn.execute(
                "INSERT INTO requests"
                " (kind, reference, idempotency_key, payment_method, received_at)"
                " VALUES (?, ?, ?, ?, ?)",
                (kind, reference, idempotency_key, payment_method, format_timestamp(received_at)),
            )
            request_id = cursor.lastrowid
        assert request_id is not None  # an INSERT into a rowid table always yields one
        return request_id

    def record_response_status(self, request_id: int, status: int) -> None:
        with self._connection() as conn:
            conn.execute(
                "UPDATE requests SET response_status = ? WHERE id = ?", (status, request_id)
            )

    def submit(
        self,
        request_id: int,
        request: ChargeRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
    ) -> SubmitOutcome:
        """Check the key, decide, execute and keep the answer — all in one write transaction,
        so two requests carrying one key can never both execute, whichever process they hit.

        `effect_for` receives whether this is the first submit logged for the reference.
        """
        with self._connection() as conn, _write_transaction(conn):
            live = self._live_key(conn, request.idempotency_key, now)
            if live is not None:
                fingerprint, stored = live
                if fingerprint != request.fingerprint:
                    return KeyReused()
                return Replayed(stored)
            first_attempt = not _has_earlier_submit(conn, request.reference, request_id)
            response = self._apply(conn, effect_for(first_attempt), request, now)
            return Processed(first_attempt, response)

    # -- reads ----------------------------------------------------------------------------

    def charges(self, reference: str | None = None) -> list[Charge]:
        query = "SELECT * FROM charges"
        params: tuple[str, ...] = ()
        if reference is not None:
            query += " WHERE reference = ?"
            params = (reference,)
        with self._connection() as conn:
            rows = conn.execute(query + " ORDER BY executed_at, rowid", params).fetchall()
        return [_charge_from_row(row) for row in rows]

    def requests(self, reference: str | None = None) -> list[RequestRecord]:
        query = "SELECT * FROM requests"
        params: tuple[str, ...] = ()
        if reference is not None:
            query += " WHERE reference = ?"
            params = (reference,)
        with self._connection() as conn:
            rows = conn.execute(query + " ORDER BY id", params).fetchall()
        return [_request_from_row(row) for row in rows]

    def was_submitted_with(self, reference: str, payment_method: str) -> bool:
        with self._connection() as conn:
            row = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM requests WHERE kind = 'submit'"
                " AND reference = ? AND payment_method = ?)",
                (reference, payment_method),
            ).fetchone()
        return bool(row[0])

    def ping(self) -> None:
        with self._connection() as conn:
            conn.execute("SELECT 1").fetchone()

    # -- inside the submit transaction ------------------------------------------------------

    def _live_key(
        self, conn: sqlite3.Connection, key: str, now: datetime
    ) -> tuple[str, StoredResponse] | None:
        row = conn.execute("SELECT * FROM idempotency_keys WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        if now - parse_timestamp(row["first_used_at"]) >= self._key_retention:
            # Past retention the provider has forgotten the key: the request is brand new.
            conn.execute("DELETE FROM idempotency_keys WHERE key = ?", (key,))
            return None
        stored = StoredResponse(row["response_status"], json.loads(row["response_body"]))
        return row["request_fingerprint"], stored

    def _apply(
        self, conn: sqlite3.Connection, effect: Effect, request: ChargeRequest, now: datetime
    ) -> StoredResponse | None:
        match effect:
            case ExecuteCharge():
                charge = _insert_charge(conn, request, now)
                response = StoredResponse(200, charge.as_provider_response())
            case StoreRefusal(response=response):
                pass
            case LeaveUnexecuted():
                return None
        _keep_response(conn, request, now, response)
        return response

    # -- connections ------------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        self._ensure_schema()
        conn = self._open()
        try:
            yield conn
        finally:
            conn.close()

    def _open(self) -> sqlite3.Connection:
        # isolation_level=None: the module must not open transactions behind our back; the
        # submit path needs BEGIN IMMEDIATE, which only an explicit statement gives.
        conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        # FULL: an executed charge must survive a power cut, not just a process crash.
        conn.execute("PRAGMA synchronous = FULL")
        return conn

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        with self._schema_lock:
            if self._schema_ready:
                return
            conn = self._open()
            try:
                # WAL lets readers (lookups, the truth) proceed while a submit holds the
                # write lock; the mode is persistent in the file, so this is a one-off.
                conn.execute("PRAGMA journal_mode = WAL")
                with _write_transaction(conn):
                    for statement in _SCHEMA:
                        conn.execute(statement)
            finally:
                conn.close()
            self._schema_ready = True


@contextmanager
def _write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    # IMMEDIATE takes the write lock up front: a deferred transaction that read first could
    # not upgrade under WAL once another writer committed, and would fail instead of waiting.
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _has_earlier_submit(conn: sqlite3.Connection, reference: str, request_id: int) -> bool:
    # Comparing ids (not counting rows) keeps "first attempt" well defined when several
    # submits for one reference arrive together: the earliest logged one is the first.
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM requests WHERE kind = 'submit' AND reference = ? AND id < ?)",
        (reference, request_id),
    ).fetchone()
    return bool(row[0])


def _insert_charge(conn: sqlite3.Connection, request: ChargeRequest, now: datetime) -> Charge:
    charge = Charge(
        id="ch_" + secrets.token_hex(12),
        reference=request.reference,
        idempotency_key=request.idempotency_key,
        amount=request.amount,
        currency=request.currency,
        payment_method=request.payment_method,
        executed_at=now,
    )
    conn.execute(
        "INSERT INTO charges"
        " (id, reference, idempotency_key, amount, currency, payment_method, executed_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            charge.id,
            charge.reference,
            charge.idempotency_key,
            charge.amount,
            charge.currency,
            charge.payment_method,
            format_timestamp(charge.executed_at),
        ),
    )
    return charge


def _keep_response(
    conn: sqlite3.Connection, request: ChargeRequest, now: datetime, response: StoredResponse
) -> None:
    conn.execute(
        "INSERT INTO idempotency_keys"
        " (key, first_used_at, request_fingerprint, response_status, response_body)"
        " VALUES (?, ?, ?, ?, ?)",
        (
            request.idempotency_key,
            format_timestamp(now),
            request.fingerprint,
            response.status,
            json.dumps(response.body, separators=(",", ":")),
        ),
    )


def _charge_from_row(row: sqlite3.Row) -> Charge:
    return Charge(
        id=row["id"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        amount=row["amount"],
        currency=row["currency"],
        payment_method=row["payment_method"],
        executed_at=parse_timestamp(row["executed_at"]),
    )


def _request_from_row(row: sqlite3.Row) -> RequestRecord:
    return RequestRecord(
        id=row["id"],
        kind=row["kind"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        payment_method=row["payment_method"],
        received_at=parse_timestamp(row["received_at"]),
        response_status=row["response_status"],
    )
