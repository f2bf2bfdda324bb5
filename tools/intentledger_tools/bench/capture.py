"""Record the statements the real code paths send, so the baselines run our own SQL.

The bench does not keep a hand-written copy of the intake or dispatch SQL that
could drift from the code: it runs `accept()` once and one real delivery
(`Worker.deliver_batch` against the sandbox) on the bench database and records
every statement SQLAlchemy hands psycopg, grouped into transactions. The
pgbench scripts and the bulk loaders are rendered from these recordings.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.canonical import request_hash
from intentledger.engine.clock import system_clock
from intentledger.engine.intake import Intent, accept
from intentledger.service import build_worker
from intentledger.settings import MAX_RECORD_WINDOW, Settings
from intentledger.store.database import create_ledger_engine
from intentledger.store.tables import idempotency_records, operations, outbox, transitions

PAYMENTS_ROUTE = "POST /v1/payments"
BENCH_ACTOR = "bench"


def payment_body(payment_method: str) -> dict[str, Any]:
    """The body every bench payment carries, as the API normalises it."""
    return {"amount": 1250, "currency": "EUR", "payment_method": payment_method, "metadata": {}}


@dataclass(frozen=True)
class Statement:
    sql: str  # psycopg's pyformat: %(name)s placeholders
    params: dict[str, Any]
    # Sent by an executemany, which psycopg pipelines: one round trip for the lot.
    pipelined: bool = False

    @property
    def table(self) -> str | None:
        """The table of an INSERT, else None."""
        words = self.sql.split(None, 3)
        if len(words) >= 3 and words[0].upper() == "INSERT" and words[1].upper() == "INTO":
            return words[2]
        return None


@dataclass
class Recording:
    """Statements grouped by transaction, in the order they were sent."""

    transactions: list[list[Statement]] = field(default_factory=list)
    _open: list[Statement] | None = None

    def begin(self) -> None:
        self._open = []

    def end(self) -> None:
        if self._open:
            self.transactions.append(self._open)
        self._open = None

    def statement(self, sql: str, params: Any, many: bool = False) -> None:
        # Only statements inside a transaction count: pool pings are not ours to copy.
        if self._open is None:
            return
        if many and not isinstance(params, Mapping):
            # psycopg sends an executemany as one statement per parameter set (pipelined).
            for one in params:
                self._open.append(Statement(sql, dict(one or {}), pipelined=True))
        else:
            # One statement; SQLAlchemy's multi-row INSERT ("insertmanyvalues") too.
            self._open.append(Statement(sql, dict(params or {})))

    @property
    def statements(self) -> list[Statement]:
        return [s for tx in self.transactions for s in tx]


@contextmanager
def recording(engine: AsyncEngine) -> Iterator[Recording]:
    rec = Recording()
    sync = engine.sync_engine

    def on_begin(_conn: Any) -> None:
        rec.begin()

    def on_end(_conn: Any) -> None:
        rec.end()

    def on_execute(
        _conn: Any, _cursor: Any, sql: str, params: Any, _context: Any, many: bool
    ) -> None:
        rec.statement(sql, params, many)

    listeners: list[tuple[str, Any]] = [
        ("begin", on_begin),
        ("commit", on_end),
        ("rollback", on_end),
        ("before_cursor_execute", on_execute),
    ]
    for name, fn in listeners:
        event.listen(sync, name, fn)
    try:
        yield rec
    finally:
        for name, fn in listeners:
            event.remove(sync, name, fn)


@dataclass(frozen=True)
class IntakeCapture:
    """One `accept()`: the key claimed (INSERT ... ON CONFLICT DO NOTHING), then
    intake's writer (store/intake.py; on PostgreSQL one call of its function)."""

    transaction: list[Statement]
    operation_id: str
    idempotency_key: str
    # (table, column values) of each row the intake wrote, in the order it
    # writes them, read back after the commit (the writer sends its rows as
    # one JSON parameter, not as an INSERT per table).
    rows: list[tuple[str, dict[str, Any]]]

    def insert_values(self) -> list[tuple[str, dict[str, Any]]]:
        """(table, column values) of each row the intake wrote, in its order."""
        return self.rows


@dataclass(frozen=True)
class DispatchCapture:
    """One batch delivery: the claim, the pre-submit and the record transactions.

    `claimed` pairs each claimed outbox row id with its operation id, in row id order.
    """

    transactions: list[list[Statement]]
    claimed: list[tuple[int, str]]

    @property
    def batch(self) -> int:
        return len(self.claimed)


async def capture_intake(engine: AsyncEngine, key: str = "bench-capture-key") -> IntakeCapture:
    body = payment_body("pm_ok")
    intent = Intent(
        actor=BENCH_ACTOR,
        route=PAYMENTS_ROUTE,
        idempotency_key=key,
        request_hash=request_hash(BENCH_ACTOR, PAYMENTS_ROUTE, body),
        body=body,
        provider="sandbox",
    )
    with recording(engine) as rec:
        result = await accept(engine, system_clock, intent)
    if len(rec.transactions) != 1:
        raise RuntimeError(f"expected one intake transaction, saw {len(rec.transactions)}")
    rows = await _rows_written(engine, result.operation_id)
    return IntakeCapture(rec.transactions[0], result.operation_id, key, rows)


async def _rows_written(engine: AsyncEngine, operation_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The intake's rows of `operation_id`: every column but the generated ids
    and those left NULL (NULL is what a load that leaves them out writes)."""
    written: list[tuple[str, dict[str, Any]]] = []
    async with engine.connect() as conn:
        for table, column in (
            (idempotency_records, idempotency_records.c.resource_id),
            (operations, operations.c.operation_id),
            (outbox, outbox.c.operation_id),
            (transitions, transitions.c.operation_id),
        ):
            row = (await conn.execute(select(table).where(column == operation_id))).one()
            values = {
                name: value
                for name, value in row._mapping.items()
                if name != "id" and value is not None
            }
            written.append((table.name, values))
    return written


async def capture_dispatch(database_url: str, sandbox_url: str, batch: int) -> DispatchCapture:
    """Deliver the `batch` due submit rows as a worker loop does, through the sandbox."""
    # Answers are recorded as they arrive, grouped by a window: the longest one
    # makes a claim's answers one record transaction, the statement captured.
    settings = Settings(
        database_url=database_url, provider_url=sandbox_url, record_window=MAX_RECORD_WINDOW
    )
    engine = create_ledger_engine(database_url)
    # On the engine: the same statements a worker sends on its own
    # connections, where SQLAlchemy's events record them.
    worker = build_worker(settings, engine, system_clock, None, direct=False)
    try:
        async with engine.connect() as conn:
            claimable = (
                await conn.execute(
                    select(outbox.c.id, outbox.c.operation_id)
                    .where(outbox.c.done_at.is_(None))
                    .order_by(outbox.c.id)
                )
            ).all()
        with recording(engine) as rec:
            # One row: the one-at-a-time path; more: one claim's batch.
            if batch == 1:
                delivered = int(await worker.deliver_next())
            else:
                delivered = await worker.deliver_batch(batch)
    finally:
        await worker.close()
        await engine.dispose()
    if delivered != batch or len(claimable) != batch:
        raise RuntimeError(f"expected to deliver {batch} rows, delivered {delivered}")
    if len(rec.transactions) != 3:
        raise RuntimeError(
            f"expected claim, pre-submit and record transactions; saw {len(rec.transactions)}"
        )
    return DispatchCapture(rec.transactions, [(row.id, row.operation_id) for row in claimable])
