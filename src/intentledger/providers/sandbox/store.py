"""The sandbox provider's own truth: every charge, beneficiary, card and card action it
executed, every key it honours, every request it received.

It lives in one SQLite file so that any number of OS processes mounting the sandbox share a
single truth, and so that the truth survives a restart. Calls block; callers run them in a
worker thread. Each thread keeps its own connection because sqlite3 connections must not be
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
from datetime import datetime, timedelta
from typing import Literal, Protocol

from intentledger.providers.sandbox import resources
from intentledger.providers.sandbox.resources import (
    Beneficiary,
    BeneficiaryRequest,
    Card,
    CardAction,
    CardActionRequest,
    CardRequest,
    Refund,
    RefundRequest,
)
from intentledger.providers.sandbox.rows import (
    JSONObject,
    format_timestamp,
    parse_timestamp,
    where_equal,
)

RequestKind = Literal["submit", "lookup"]
# What a request is about; `kind` stays submit | lookup so callers filtering on it still work.
Resource = Literal["charge", "beneficiary", "card", "card_action", "refund"]

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
    *resources.SCHEMA,
)

# Columns `requests` gained after its first release. A file written before them gets them in
# place, and its existing rows -- all charge requests then -- take the defaults. No CHECK on
# `resource`: SQLite cannot change one later without rebuilding the table.
_ADDED_REQUEST_COLUMNS = (
    ("resource", "TEXT NOT NULL DEFAULT 'charge'"),
    ("sandbox_scenario", "TEXT"),
    ("card_id", "TEXT"),
)

# Indexes over the added columns, created once the columns exist.
_SCHEMA_AFTER_UPGRADE = (
    "CREATE INDEX IF NOT EXISTS requests_by_resource ON requests (resource, reference, kind)",
)


@dataclass(frozen=True)
class StoredResponse:
    """A final answer, kept against its idempotency key so a retry replays it."""

    status: int
    body: JSONObject


class KeyedRequest(Protocol):
    """What the key check needs from any write, whatever it writes."""

    @property
    def reference(self) -> str: ...

    @property
    def idempotency_key(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...


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
class ReceivedRequest:
    """A request as it arrived, logged before anything is decided about it."""

    resource: Resource
    kind: RequestKind
    reference: str | None
    idempotency_key: str | None
    received_at: datetime
    payment_method: str | None = None
    sandbox_scenario: str | None = None
    card_id: str | None = None


@dataclass(frozen=True)
class RequestRecord:
    id: int
    resource: Resource
    kind: RequestKind
    reference: str | None
    idempotency_key: str | None
    payment_method: str | None
    sandbox_scenario: str | None
    card_id: str | None
    received_at: datetime
    response_status: int | None

    def as_entry(self) -> JSONObject:
        return {
            "id": self.id,
            "resource": self.resource,
            "kind": self.kind,
            "reference": self.reference,
            "idempotency_key": self.idempotency_key,
            "payment_method": self.payment_method,
            "sandbox_scenario": self.sandbox_scenario,
            "card_id": self.card_id,
            "received_at": format_timestamp(self.received_at),
            "response_status": self.response_status,
        }


# What a fresh (non-replayed) write does to the truth, decided inside the transaction.


@dataclass(frozen=True)
class Execute:
    """Do the write (move the money, create the beneficiary, ...) and keep the 200 against the
    key."""


@dataclass(frozen=True)
class StoreRefusal:
    """A final answer that moved no money (a decline); kept against the key like Stripe does."""

    response: StoredResponse


@dataclass(frozen=True)
class LeaveUnexecuted:
    """Nothing moved and nothing is kept, so a retry with the same key runs afresh."""


Effect = Execute | StoreRefusal | LeaveUnexecuted

# Does an executing write inside the transaction and returns the answer to keep.
Execution = Callable[[sqlite3.Connection, datetime], StoredResponse]


# What the write transaction found and did.


@dataclass(frozen=True)
class Replayed:
    response: StoredResponse


@dataclass(frozen=True)
class KeyReused:
    """The key is live but was first used with a different request body."""


@dataclass(frozen=True)
class TargetMissing:
    """The write acts on a resource that does not exist: nothing executed, nothing kept, so
    the key stays free for a corrected request."""

    resource: str
    id: str


@dataclass(frozen=True)
class Processed:
    first_attempt: bool
    response: StoredResponse | None


WriteOutcome = Replayed | KeyReused | TargetMissing | Processed


class SandboxStore:
    """The sandbox's truth in SQLite.

    The app calls it on its event loop: a call is a statement or two, well under
    a millisecond under WAL, and a trip to a worker thread cost more CPU than
    that (a third of the sandbox's CPU per charge, docs/benchmarks.md step 19).
    A withheld answer waits with `await`, never in here. Another process writing
    the same file (several `serve` processes sharing one sandbox file) can make a
    call wait on the loop in SQLite's busy handler while that process's short
    write finishes. The lock and the per-thread connections keep the store safe
    to call from any thread as well.
    """

    def __init__(self, database_path: str, key_retention: timedelta) -> None:
        self._path = database_path
        self._key_retention = key_retention
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        # One connection per thread, kept: sqlite3 connections must stay on the
        # thread that made them, and opening one per call costs more than the call.
        self._per_thread = threading.local()
        # This process's writers queue here rather than in SQLite's busy handler,
        # which sleeps in steps of up to 100 ms; other processes still meet the
        # busy timeout.
        self._write_lock = threading.Lock()

    # -- writes ---------------------------------------------------------------------------

    def log_request(self, received: ReceivedRequest) -> int:
        with self._writing() as conn:
            cursor = conn.execute(
                "INSERT INTO requests"
                " (resource, kind, reference, idempotency_key, payment_method, sandbox_scenario,"
                " card_id, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    received.resource,
                    received.kind,
                    received.reference,
                    received.idempotency_key,
                    received.payment_method,
                    received.sandbox_scenario,
                    received.card_id,
                    format_timestamp(received.received_at),
                ),
            )
            request_id = cursor.lastrowid
        assert request_id is not None  # an INSERT into a rowid table always yields one
        return request_id

    def record_response_status(self, request_id: int, status: int) -> None:
        with self._writing() as conn:
            conn.execute(
                "UPDATE requests SET response_status = ? WHERE id = ?", (status, request_id)
            )

    def submit(
        self,
        request_id: int,
        request: ChargeRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
    ) -> WriteOutcome:
        """Check the key, decide, execute and keep the answer — all in one write transaction,
        so two requests carrying one key can never both execute, whichever process they hit.

        `effect_for` receives whether this is the first submit logged for the reference.
        """

        def execute(conn: sqlite3.Connection, now: datetime) -> StoredResponse:
            return StoredResponse(200, _insert_charge(conn, request, now).as_provider_response())

        return self._keyed_write("charge", request_id, request, now, effect_for, execute)

    def create_beneficiary(
        self,
        request_id: int,
        request: BeneficiaryRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
    ) -> WriteOutcome:
        def execute(conn: sqlite3.Connection, now: datetime) -> StoredResponse:
            beneficiary = resources.insert_beneficiary(conn, request, now)
            return StoredResponse(200, beneficiary.as_provider_response())

        return self._keyed_write("beneficiary", request_id, request, now, effect_for, execute)

    def issue_card(
        self,
        request_id: int,
        request: CardRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
    ) -> WriteOutcome:
        def execute(conn: sqlite3.Connection, now: datetime) -> StoredResponse:
            return StoredResponse(
                200, resources.insert_card(conn, request, now).as_provider_response()
            )

        return self._keyed_write("card", request_id, request, now, effect_for, execute)

    def act_on_card(
        self,
        request_id: int,
        request: CardActionRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
    ) -> WriteOutcome:
        def execute(conn: sqlite3.Connection, now: datetime) -> StoredResponse:
            card = resources.apply_card_action(conn, request, now)
            return StoredResponse(200, card.as_provider_response())

        def card_missing(conn: sqlite3.Connection) -> TargetMissing | None:
            if resources.find_card(conn, request.card_id) is None:
                return TargetMissing("card", request.card_id)
            return None

        return self._keyed_write(
            "card_action", request_id, request, now, effect_for, execute, card_missing
        )

    def create_refund(
        self,
        request_id: int,
        request: RefundRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
    ) -> WriteOutcome:
        def execute(conn: sqlite3.Connection, now: datetime) -> StoredResponse:
            return StoredResponse(
                200, resources.insert_refund(conn, request, now).as_provider_response()
            )

        def charge_missing(conn: sqlite3.Connection) -> TargetMissing | None:
            if not resources.charge_exists(conn, request.charge_id):
                return TargetMissing("charge", request.charge_id)
            return None

        return self._keyed_write(
            "refund", request_id, request, now, effect_for, execute, charge_missing
        )

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

    def beneficiaries(self, reference: str | None = None) -> list[Beneficiary]:
        with self._connection() as conn:
            return resources.select_beneficiaries(conn, reference)

    def cards(self, reference: str | None = None) -> list[Card]:
        with self._connection() as conn:
            return resources.select_cards(conn, reference)

    def refunds(self, reference: str | None = None, charge_id: str | None = None) -> list[Refund]:
        with self._connection() as conn:
            return resources.select_refunds(conn, reference, charge_id)

    def card(self, card_id: str) -> Card | None:
        with self._connection() as conn:
            return resources.find_card(conn, card_id)

    def card_actions(
        self, reference: str | None = None, card_id: str | None = None
    ) -> list[CardAction]:
        with self._connection() as conn:
            return resources.select_card_actions(conn, reference, card_id)

    def requests(
        self, reference: str | None = None, resource: str | None = None
    ) -> list[RequestRecord]:
        where, params = where_equal(reference=reference, resource=resource)
        with self._connection() as conn:
            rows = conn.execute(f"SELECT * FROM requests{where} ORDER BY id", params).fetchall()
        return [_request_from_row(row) for row in rows]

    def was_submitted_with(self, reference: str, payment_method: str) -> bool:
        with self._connection() as conn:
            row = conn.execute(
                "SELECT EXISTS (SELECT 1 FROM requests WHERE resource = 'charge'"
                " AND kind = 'submit' AND reference = ? AND payment_method = ?)",
                (reference, payment_method),
            ).fetchone()
        return bool(row[0])

    def ping(self) -> None:
        with self._connection() as conn:
            conn.execute("SELECT 1").fetchone()

    # -- the write transaction ------------------------------------------------------------

    def _keyed_write(
        self,
        resource: Resource,
        request_id: int,
        request: KeyedRequest,
        now: datetime,
        effect_for: Callable[[bool], Effect],
        execute: Execution,
        target_missing: Callable[[sqlite3.Connection], TargetMissing | None] | None = None,
    ) -> WriteOutcome:
        """One write transaction for any kind of write: the key first (a live key replays or
        conflicts whatever else has changed since), then the target, then the effect."""
        with self._writing() as conn, _write_transaction(conn):
            live = self._live_key(conn, request.idempotency_key, now)
            if live is not None:
                fingerprint, stored = live
                if fingerprint != request.fingerprint:
                    return KeyReused()
                return Replayed(stored)
            if target_missing is not None and (missing := target_missing(conn)) is not None:
                return missing
            first_attempt = not _has_earlier_submit(conn, resource, request.reference, request_id)
            response = _apply(conn, effect_for(first_attempt), request, now, execute)
            return Processed(first_attempt, response)

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

    # -- connections ------------------------------------------------------------------------

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        self._ensure_schema()
        conn: sqlite3.Connection | None = getattr(self._per_thread, "conn", None)
        if conn is None:
            conn = self._open()
            self._per_thread.conn = conn
        yield conn

    @contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        with self._write_lock, self._connection() as conn:
            yield conn

    def _open(self) -> sqlite3.Connection:
        # isolation_level=None: the module must not open transactions behind our back; the
        # submit path needs BEGIN IMMEDIATE, which only an explicit statement gives.
        conn = sqlite3.connect(self._path, timeout=BUSY_TIMEOUT_SECONDS, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_SECONDS * 1000)}")
        # NORMAL under WAL: a committed charge survives any crash of the processes
        # (the tests SIGKILL them, the sandbox included), though not a power cut.
        # A test double's truth needs no more, and FULL's fsync per commit made
        # the sandbox, not the system under test, the bottleneck of every run.
        conn.execute("PRAGMA synchronous = NORMAL")
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
                # One write transaction: two processes upgrading one old file cannot both see
                # a column missing and both add it.
                with _write_transaction(conn):
                    for statement in _SCHEMA:
                        conn.execute(statement)
                    _add_missing_request_columns(conn)
                    for statement in _SCHEMA_AFTER_UPGRADE:
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


def _add_missing_request_columns(conn: sqlite3.Connection) -> None:
    present = {row["name"] for row in conn.execute("PRAGMA table_info(requests)").fetchall()}
    for name, definition in _ADDED_REQUEST_COLUMNS:
        if name not in present:
            conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {definition}")


def _has_earlier_submit(
    conn: sqlite3.Connection, resource: Resource, reference: str, request_id: int
) -> bool:
    # Comparing ids (not counting rows) keeps "first attempt" well defined when several
    # submits for one reference arrive together: the earliest logged one is the first.
    # Per resource: a card issued under an operation's reference is not an earlier attempt
    # of a charge (or a beneficiary) under the same reference.
    row = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM requests WHERE resource = ? AND kind = 'submit'"
        " AND reference = ? AND id < ?)",
        (resource, reference, request_id),
    ).fetchone()
    return bool(row[0])


def _apply(
    conn: sqlite3.Connection,
    effect: Effect,
    request: KeyedRequest,
    now: datetime,
    execute: Execution,
) -> StoredResponse | None:
    match effect:
        case Execute():
            response = execute(conn, now)
        case StoreRefusal(response=response):
            pass
        case LeaveUnexecuted():
            return None
    _keep_response(conn, request, now, response)
    return response


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
    conn: sqlite3.Connection, request: KeyedRequest, now: datetime, response: StoredResponse
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
        resource=row["resource"],
        kind=row["kind"],
        reference=row["reference"],
        idempotency_key=row["idempotency_key"],
        payment_method=row["payment_method"],
        sandbox_scenario=row["sandbox_scenario"],
        card_id=row["card_id"],
        received_at=parse_timestamp(row["received_at"]),
        response_status=row["response_status"],
    )
