"""A worker's batched first attempts on PostgreSQL, on psycopg connections of
their own.

A transport, not a second store: the claim, the pre-submit and the group
record send the statements `BatchLedger` and `Ledger` build with SQLAlchemy
Core, compiled once for each shape, only over other connections. Sent through
SQLAlchemy's async engine a transaction also paid for a pool checkout and its
pre-ping (a round trip), greenlet switches, an execution context per statement
and the results' wrapping: in a process that did nothing else, 0.73 ms of CPU
for a transaction of one trivial statement against 0.21 ms sent straight, and
0.80 ms against 0.49 to lock 25 operations (docs/benchmarks.md, "The hot path
past SQLAlchemy's execution"). The server does the same work either way, so
what goes is the worker's alone.

Nor through psycopg's cursor: a statement goes through psycopg's libpq
layer (store/libpq.py), as intake's group statement does. Its values are
dumped and its rows loaded by psycopg's own transformer with the
connection's adapters, as a cursor's are; its text is SQLAlchemy's with
libpq's numbered placeholders; the transaction is begun with the BEGIN
psycopg sends, but in one pipeline with the first statement (libpq's
pipeline mode: one round trip, where psycopg waited for BEGIN's answer
first); a statement is prepared once it has run five times on a
connection, as psycopg prepares one (never behind a pooler), in the
pipeline of its sixth run. psycopg itself prepares
nothing there: its rollback deallocates every prepared statement once it
has prepared one. A prepared statement the server finds stale (a
migration changed a column under it, 0A000; or it was deallocated,
26000) makes its transaction run again on a new connection, as a lost
connection does: nothing of it was committed. The cursor's query object,
prepared-statement cache and waiting generators, and BEGIN's own round
trip, cost a fifth of a transaction that locks 25 rows and updates them
(docs/benchmarks.md, "The hot path's statements through libpq"). An executemany, rare here, still
goes through a cursor.

What stays as it was:

- **The statements and their values.** Each is SQLAlchemy's own compilation
  for psycopg, cached by its shape (SQLAlchemy's cache key) as the engine
  caches it; its parameters are SQLAlchemy's `construct_params` of the
  caller's values and the statement's own, through the bind processors
  SQLAlchemy would apply, and its rows go through the result processors (an
  instant read back is aware UTC), so a record made here equals one made
  through the engine (tests/test_direct.py).
- **Errors.** A driver error becomes SQLAlchemy's exception of the same kind
  (an `IntegrityError` stays one), with `connection_invalidated` set when the
  connection was lost, so `lost_connection` and every `except` read it alike;
  a value a bind processor refuses is a `StatementError`, as there.
- **Counts at commit.** `metrics.after_commit` runs its actions once COMMIT
  has answered, never when the transaction rolls back.
- **No stale connection costs an answer.** There is no pre-ping. A
  transaction that fails because its connection was lost before its COMMIT was
  sent has written nothing; every idle connection is then closed (a node that
  went away or became a standby takes its siblings with it, as SQLAlchemy's
  pool drops its own), and the work runs once more on a new connection, which
  the URL's host list and `target_session_attrs` send to the primary. A
  connection found lost only at COMMIT is not retried: whether it committed
  is unknown, and the caller's reference path judges that, as it does today.

What is refused rather than half done (each a `ValueError`, never reached by
the three transactions): an expanding IN list (PostgreSQL's reads use
arrays), a column default made in Python, and an executemany's RETURNING.
"""

from __future__ import annotations

import functools
import logging
import re
import string
import weakref
from collections import namedtuple
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import psycopg
from psycopg.adapt import PyFormat, Transformer
from psycopg.pq import ExecStatus, Format, PipelineStatus, TransactionStatus
from psycopg.pq.abc import PGresult
from psycopg.rows import namedtuple_row
from sqlalchemy.engine import Dialect
from sqlalchemy.exc import (
    DBAPIError,
    InvalidRequestError,
    MultipleResultsFound,
    NoResultFound,
    StatementError,
)
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import SQLCompiler

from intentledger.store import libpq
from intentledger.store.database import Pooler, _lost_state, connect_args, libpq_url

_T = TypeVar("_T")
log = logging.getLogger(__name__)

_POSTCOMPILE = "__[POSTCOMPILE_"
# Statements a connection keeps prepared at most (psycopg's `prepared_max`);
# past it a new one is sent with its text each time. The hot path has a dozen.
PREPARED_KEPT = 100
# Statements not yet prepared whose uses a connection counts, at most.
USES_COUNTED = 1000
# What running a prepared statement answers once it cannot be trusted: 0A000,
# "cached plan must not change result type" (a column's type changed under
# it); 26000, no statement of that name (deallocated behind our back).
_STALE_PREPARED_STATES = frozenset({"0A000", "26000"})


@dataclass(frozen=True)
class _Compiled:
    compiled: SQLCompiler
    sql: str
    # SQLAlchemy's bind processor of each parameter that has one.
    bind_processors: tuple[tuple[str, Callable[[Any], Any]], ...]
    # SQLAlchemy's result processor of each column, or None where no column needs one.
    result_processors: tuple[Callable[[Any], Any] | None, ...] | None
    returns_rows: bool
    # The columns that have a processor, and it: a row's other values are kept
    # as psycopg made them, with no call (an operation's row has 32).
    processed: tuple[tuple[int, Callable[[Any], Any]], ...] = ()
    # The text libpq is sent (`$1`... where SQLAlchemy wrote `%(name)s`), in
    # UTF-8, and the parameters' names in the order of their numbers.
    numbered: bytes = b""
    order: tuple[str, ...] = ()


# SQLAlchemy's psycopg dialect writes a parameter as `%(name)s` and a percent
# sign as `%%`; psycopg reads nothing else either.
_PLACEHOLDER = re.compile(r"%\((?P<name>[^)]+)\)s|%%|%")


def _numbered(sql: str) -> tuple[bytes, tuple[str, ...]]:
    """`sql` with libpq's numbered placeholders, as psycopg converts it: a
    name used twice is one parameter; the names in the order of their numbers."""
    numbers: dict[str, int] = {}

    def placeholder(match: re.Match[str]) -> str:
        name = match.group("name")
        if name is None:
            if match.group(0) == "%%":
                return "%"
            # Nor `%(name)b` and `%(name)t`, which SQLAlchemy never writes.
            raise ValueError(f"a lone % in a statement's text: {sql[:200]!r}")
        number = numbers.setdefault(name, len(numbers) + 1)
        return f"${number}"

    text = _PLACEHOLDER.sub(placeholder, sql)
    return text.encode("utf-8"), tuple(numbers)


def _compile(
    statement: ClauseElement,
    dialect: Dialect,
    column_keys: tuple[str, ...],
    many: bool,
    keyed: bool,
) -> _Compiled:
    cache_key = statement._generate_cache_key() if keyed else None
    # `for_executemany`, as SQLAlchemy compiles an executemany: an INSERT then
    # returns no key it was not asked for.
    compiled = dialect.statement_compiler(
        dialect,
        statement,
        cache_key=cache_key,
        column_keys=list(column_keys),
        for_executemany=many,
    )
    sql = compiled.string
    if _POSTCOMPILE in sql:
        raise ValueError("an expanding parameter has no one text; PostgreSQL's reads use arrays")
    if compiled.insert_prefetch or compiled.update_prefetch:
        # A Python-side column default, which SQLAlchemy's execution fills in.
        raise ValueError("a column default made in Python is written through the engine")
    # By each parameter's name as rendered (and escaped) in the text, the keys
    # `construct_params` gives.
    escaped = compiled.escaped_bind_names
    bind_processors = tuple(
        (escaped.get(name, name), processor)
        for bind, name in compiled.bind_names.items()
        if (processor := bind.type.dialect_impl(dialect).bind_processor(dialect)) is not None
    )
    result_processors: tuple[Callable[[Any], Any] | None, ...] | None = None
    columns = getattr(statement, "exported_columns", None)
    if columns is not None and len(columns):
        processors = tuple(
            column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns
        )
        if any(p is not None for p in processors):
            result_processors = processors
    returns_rows = bool(getattr(compiled, "effective_returning", None)) or bool(
        getattr(compiled, "returning", None)
    )
    processed = tuple(
        (index, processor)
        for index, processor in enumerate(result_processors or ())
        if processor is not None
    )
    numbered, order = _numbered(sql)
    return _Compiled(
        compiled,
        sql,
        bind_processors,
        result_processors,
        returns_rows,
        processed,
        numbered,
        order,
    )


# Compiled statements by their shape (SQLAlchemy's cache key), the dialect and
# the parameters' names, the oldest dropped first past the bound: a statement
# built anew per call (a mandate's shift) is compiled once for its shape, as
# the engine's compiled cache does.
_COMPILED: dict[tuple[Any, ...], _Compiled] = {}
_COMPILED_KEPT = 512


def _compiled(
    statement: ClauseElement, dialect: Dialect, column_keys: tuple[str, ...], many: bool
) -> tuple[_Compiled, Sequence[Any] | None]:
    """`statement` as SQLAlchemy's psycopg dialect sends it given parameters
    named `column_keys` (an INSERT or UPDATE names only those columns, as
    SQLAlchemy's own execution compiles it), with what its parameters and
    rows go through there; and the statement's own values (its literals'),
    bound in place of those of the statement it was compiled from."""
    cache_key = statement._generate_cache_key()
    if cache_key is None:
        return _compile(statement, dialect, column_keys, many, keyed=False), None
    key = (cache_key.key, dialect, column_keys, many)
    found = _COMPILED.get(key)
    if found is None:
        if len(_COMPILED) >= _COMPILED_KEPT:
            del _COMPILED[next(iter(_COMPILED))]
        found = _COMPILED[key] = _compile(statement, dialect, column_keys, many, keyed=True)
    return found, cache_key.bindparams


class DirectResult:
    """A statement's rows (named tuples, read at once), with the part of
    SQLAlchemy's `Result` the store reads."""

    __slots__ = ("_rows", "rowcount")

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self.rowcount = rowcount

    def __iter__(self) -> Iterator[Any]:
        return iter(self._rows)

    def all(self) -> list[Any]:
        return self._rows

    def fetchall(self) -> list[Any]:
        return self._rows

    def first(self) -> Any | None:
        return self._rows[0] if self._rows else None

    def fetchone(self) -> Any | None:
        return self.first()

    def one(self) -> Any:
        if not self._rows:
            raise NoResultFound("No row was found when one was required")
        return self.one_or_none()

    def one_or_none(self) -> Any | None:
        if len(self._rows) > 1:
            raise MultipleResultsFound("Multiple rows were found when one or none was required")
        return self.first()

    def scalar(self) -> Any | None:
        return self._rows[0][0] if self._rows else None

    def scalar_one(self) -> Any:
        return self.one()[0]

    def scalar_one_or_none(self) -> Any | None:
        row = self.one_or_none()
        return None if row is None else row[0]

    def scalars(self) -> list[Any]:
        return [row[0] for row in self._rows]

    @property
    def inserted_primary_key(self) -> Any:
        # The hot path inserts its rows in set-at-a-time statements, whose ids
        # it reads from their RETURNING (or draws first); this is for one row.
        raise TypeError("an inserted row's key is read through the ledger engine")


# A result of rows, even of none (`cursor.description`'s test).
_ROWS = frozenset(
    int(status)
    for status in (ExecStatus.TUPLES_OK, ExecStatus.SINGLE_TUPLE, ExecStatus.TUPLES_CHUNK)
)


def _processed(row: Any, processed: tuple[tuple[int, Callable[[Any], Any]], ...]) -> Any:
    """The row (a named tuple) with each processed column's value through its processor."""
    values = list(row)
    for index, process in processed:
        values[index] = process(values[index])
    return row._make(values)


def _columns(result: PGresult) -> int | None:
    """How many columns the statement's result has; None if it returned no
    rows. What `cursor.description` tells, without making a `Column` of
    each: an operation's row has 32, and the hot path read them twice a
    statement."""
    if result.nfields or result.status in _ROWS:
        return result.nfields
    return None


@functools.lru_cache(maxsize=512)
def _row_type(names: tuple[bytes, ...], encoding: str) -> Any:
    """The named tuple of a result with these columns, named as psycopg's
    `namedtuple_row` names them, and refused as it refuses them."""
    fields = [_field_name(name.decode(encoding)) for name in names]
    try:
        return namedtuple("Row", fields)
    except ValueError as exc:
        raise psycopg.DataError(f"can't create a namedtuple row: {exc}") from None


_NOT_IN_A_NAME = re.compile(f"[^{string.ascii_letters}{string.digits}_]")


def _field_name(column: str) -> str:
    """A column's name made a field's, by psycopg's rule: a leading digit or
    underscore gets an `f` before it, any other character no identifier
    takes becomes `_`."""
    if not column.isidentifier():
        if column[:1] in tuple("0123456789"):
            column = "f" + column
        if not column.isidentifier():
            column = _NOT_IN_A_NAME.sub("_", column)
    if column[:1] == "_":
        column = "f" + column
    return column


@dataclass
class _Session:
    """What a connection keeps between its transactions: its encoding, after
    how many uses a statement is prepared on it (psycopg's
    `prepare_threshold`; None behind a pooler: never), how often each
    statement not yet prepared has run, and those prepared, by their text and
    their parameters' types, as psycopg keys its own. psycopg itself prepares
    nothing on these connections: its rollback would then deallocate every
    prepared statement, these too."""

    encoding: str
    threshold: int | None
    uses: dict[tuple[bytes, tuple[int, ...]], int] = field(default_factory=dict)
    prepared: dict[tuple[bytes, tuple[int, ...]], bytes] = field(default_factory=dict)


class DirectConnection:
    """One transaction on a psycopg connection, executing SQLAlchemy statements."""

    def __init__(
        self,
        raw: psycopg.AsyncConnection[Any],
        dialect: Dialect,
        session: _Session | None = None,
    ) -> None:
        self.raw = raw
        self.dialect = dialect
        self._session = session or _Session(raw.info.encoding, threshold=None)
        # Dumps the values and loads the rows with the connection's adapters,
        # as a cursor's own does.
        self._transformer = Transformer(raw)
        # Run when the transaction commits (observability/metrics.after_commit).
        self.on_commit: list[Callable[[], Any]] = []
        # A statement prepared here was found stale: the connection is rolled
        # back and closed, and the transaction runs again on another.
        self.stale = False
        # An error left the connection in libpq's pipeline mode: it is closed.
        self.in_pipeline = False

    def after_commit(self, action: Callable[[], Any]) -> None:
        self.on_commit.append(action)

    async def execute(
        self,
        statement: Executable,
        parameters: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> DirectResult:
        many = isinstance(parameters, Sequence)
        if isinstance(parameters, Sequence):
            named: Mapping[str, Any] = parameters[0] if parameters else {}
        else:
            named = parameters or {}
        clause = cast(ClauseElement, statement)
        compiled, own_values = _compiled(clause, self.dialect, tuple(sorted(named)), many)
        if isinstance(parameters, Sequence):
            cursor = self.raw.cursor()
            if compiled.returns_rows:
                # psycopg's executemany keeps no rows: refused, not emptied.
                raise ValueError("an executemany's RETURNING is read through the engine")
            batch = [self._bound(compiled, own_values, p) for p in parameters]
            try:
                await cursor.executemany(compiled.sql, batch)
            except psycopg.Error as exc:
                raise self.translated(exc, compiled.sql, batch) from exc
            return DirectResult([], cursor.rowcount)
        values = self._bound(compiled, own_values, parameters or {})
        try:
            result = await self._sent(compiled, values)
            columns = _columns(result)
            if columns is None:
                count = result.command_tuples
                return DirectResult([], -1 if count is None else count)
            names = tuple(result.fname(i) or b"" for i in range(columns))
            transformer = self._transformer
            transformer.set_pgresult(result)
            row_type = _row_type(names, self._session.encoding)
            rows = transformer.load_rows(0, result.ntuples, row_type._make)
        except psycopg.Error as exc:
            raise self.translated(exc, compiled.sql, values) from exc
        processors = compiled.result_processors
        if processors is not None and rows:
            if columns != len(processors):
                raise ValueError("a statement's columns are not those it exports")
            rows = [_processed(row, compiled.processed) for row in rows]
        return DirectResult(rows, result.ntuples)

    async def _sent(self, compiled: _Compiled, values: Mapping[str, Any]) -> PGresult:
        """The statement's result, sent through libpq (store/libpq.py) as a
        cursor sends it: its values dumped by the connection's adapters, in a
        transaction begun first, and run by name once psycopg would have
        prepared it (not behind a pooler)."""
        raw, session = self.raw, self._session
        pgconn = raw.pgconn
        if pgconn.transaction_status == TransactionStatus.ACTIVE:
            # psycopg's lock would queue a second statement behind the first;
            # a transaction here runs its statements one after another.
            raise psycopg.InterfaceError("another statement is under way on this connection")
        try:
            params = [values[name] for name in compiled.order]
        except KeyError as missing:
            raise psycopg.ProgrammingError(f"query parameter missing: {missing.args[0]}") from None
        transformer = self._transformer
        dumped = transformer.dump_sequence(params, [PyFormat.AUTO] * len(params))
        types = tuple(transformer.types or ())
        formats = transformer.formats
        text = compiled.numbered
        if session.encoding != "utf-8":
            text = text.decode("utf-8").encode(session.encoding)
        key = (text, types)
        name = session.prepared.get(key)
        preparing = name is None and self._ready_to_prepare(key)
        if preparing:
            # Never one of psycopg's own names (`_pg3_N`), nor one used before.
            name = b"_intentledger_%d" % len(session.prepared)
        beginning = pgconn.transaction_status == TransactionStatus.IDLE and not raw.autocommit
        pipeline = beginning or preparing
        try:
            if pipeline:
                # BEGIN, the statement's preparation and the statement go out
                # together, as libpq's pipeline mode sends them, and are
                # answered in one round trip: the server runs each in turn as
                # if it had waited for the one before.
                pgconn.enter_pipeline_mode()
                if beginning:
                    pgconn.send_query_params(b"BEGIN", None)
                if preparing:
                    assert name is not None
                    pgconn.send_prepare(name, text, param_types=types)
            if name is None:
                pgconn.send_query_params(
                    text,
                    dumped,
                    param_types=types,
                    param_formats=formats,
                    result_format=Format.TEXT,
                )
            else:
                pgconn.send_query_prepared(
                    name, dumped, param_formats=formats, result_format=Format.TEXT
                )
            if pipeline:
                pgconn.pipeline_sync()
                answers = await libpq.pipelined(raw)
                pgconn.exit_pipeline_mode()
            else:
                answers = [await libpq.results(raw)]
        except BaseException:
            if pgconn.pipeline_status != PipelineStatus.OFF:
                # Left in libpq's pipeline mode, which psycopg knows nothing
                # of: its ROLLBACK (a simple query, which libpq refuses there,
                # or would hold until a synchronisation point) is not tried.
                # The connection is closed.
                self.in_pipeline = True
            raise
        if preparing and answers[-2] and answers[-2][0].status == ExecStatus.COMMAND_OK:
            assert name is not None
            session.prepared[key] = name
            session.uses.pop(key, None)
        failed = libpq.first_failure(raw, [result for answer in answers for result in answer])
        if failed is not None:
            if not preparing and name is not None and failed.sqlstate in _STALE_PREPARED_STATES:
                # A migration changed what the statement returns, or its name
                # is gone: no statement prepared on this connection is to be
                # trusted. Its transaction runs again on a new one (nothing of
                # it was committed), and it is not kept.
                self.stale = True
            raise failed
        if name is None:
            self._ran_unprepared(key)
        if not answers[-1]:
            raise psycopg.InterfaceError("the server answered a statement with no result")
        return answers[-1][0]

    def _ready_to_prepare(self, key: tuple[bytes, tuple[int, ...]]) -> bool:
        """Whether a statement not prepared on this connection is to be now:
        once it has run `prepare_threshold` times without, as psycopg prepares
        one (its sixth use, psycopg's default being 5); never behind a pooler,
        nor past the bound of statements a connection keeps prepared
        (psycopg's `prepared_max`, whose oldest psycopg would drop)."""
        session = self._session
        threshold = session.threshold
        return (
            threshold is not None
            and len(session.prepared) < PREPARED_KEPT
            and session.uses.get(key, 0) >= threshold
        )

    def _ran_unprepared(self, key: tuple[bytes, tuple[int, ...]]) -> None:
        """Count a run of a statement not prepared here that succeeded (psycopg
        counts only those)."""
        uses = self._session.uses
        if key not in uses and len(uses) >= USES_COUNTED:
            uses.clear()
        uses[key] = uses.get(key, 0) + 1

    @staticmethod
    def _bound(
        compiled: _Compiled, own_values: Sequence[Any] | None, parameters: Mapping[str, Any]
    ) -> MutableMapping[str, Any]:
        """The statement's parameters as SQLAlchemy binds them: its own values
        and the caller's, through each one's bind processor; an error in
        them is SQLAlchemy's `StatementError`, as the engine raises it."""
        try:
            values = compiled.compiled.construct_params(
                dict(parameters), extracted_parameters=own_values
            )
            for name, processor in compiled.bind_processors:
                values[name] = processor(values[name])
        except Exception as exc:
            raise StatementError(
                f"({type(exc).__module__}.{type(exc).__name__}) {exc}",
                compiled.sql,
                None,
                exc,
            ) from exc
        return values

    def translated(self, exc: psycopg.Error, sql: str | None, params: Any) -> BaseException:
        """SQLAlchemy's exception for a driver error, as its engine raises it."""
        return DBAPIError.instance(
            sql,
            params,
            exc,
            psycopg.Error,
            hide_parameters=True,
            connection_invalidated=lost(exc, self.raw),
            dialect=self.dialect,
        )


def lost(exc: BaseException, raw: psycopg.AsyncConnection[Any]) -> bool:
    """Was the connection lost (or its node gone or no longer the primary),
    rather than the statement refused? SQLAlchemy's psycopg dialect's test
    and the ledger's lost SQLSTATEs (store/database.py)."""
    if raw.closed or raw.broken:
        return True
    return _lost_state(str(getattr(exc, "sqlstate", None) or ""))


class _LostBeforeCommit(Exception):
    """A transaction's connection was lost before its COMMIT was sent."""


class DirectConnections:
    """The hot path's connections: a stack of idle ones, reused last-in
    first-out, and a new one whenever none is idle. A worker runs at most its
    claim or pre-submit and its settlement queue's groups at once, so there
    are a few; psycopg_pool's pool would add its own tasks and could not drop
    every connection at once when a node is lost."""

    def __init__(self, url: str, dialect: Dialect, pooler: Pooler = "none") -> None:
        self._conninfo = libpq_url(url)
        self._connect_args = connect_args(url, pooler)
        self.dialect = dialect
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        # Each connection's prepared statements, for as long as it lives.
        self._sessions: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], _Session] = (
            weakref.WeakKeyDictionary()
        )
        # Bumped when a connection is lost: one checked out before it is closed
        # on its return, not kept.
        self._generation = 0
        self._closed = False

    async def run(self, work: Callable[[DirectConnection], Awaitable[_T]]) -> _T:
        """`work` in one transaction, committed if it returns; once more on a
        new connection if the first was lost before its COMMIT was sent, or
        found a statement prepared on it stale."""
        try:
            return await self._run_once(work)
        except _LostBeforeCommit as lost_first:
            assert lost_first.__cause__ is not None
            try:
                return await self._run_once(work)
            except _LostBeforeCommit as lost_again:
                raise lost_again.__cause__ from None  # type: ignore[misc]

    async def _run_once(self, work: Callable[[DirectConnection], Awaitable[_T]]) -> _T:
        raw, generation = await self._checkout()
        conn = DirectConnection(raw, self.dialect, self._sessions[raw])
        # Kept for the next transaction only if this one committed or failed
        # with an error (then rolled back); one cancelled mid-statement may be
        # in any state, and is closed.
        state = "interrupted"
        try:
            try:
                result = await work(conn)
            except DBAPIError as exc:
                state = "failed"
                if exc.connection_invalidated or conn.stale:
                    # Its siblings are as lost, or hold the same stale statements.
                    await self._drop_idle()
                    raise _LostBeforeCommit() from exc
                raise
            except psycopg.Error as exc:
                state = "failed"
                translated = conn.translated(exc, None, None)
                if lost(exc, raw) or conn.stale:
                    await self._drop_idle()
                    raise _LostBeforeCommit() from translated
                raise translated from exc
            except Exception:
                state = "failed"
                raise
            if raw.info.transaction_status == TransactionStatus.INERROR:
                # A statement failed and `work` went on: COMMIT would roll back
                # and say nothing.
                state = "failed"
                raise InvalidRequestError("a statement of this transaction failed; not committed")
            try:
                await raw.commit()
            except psycopg.Error as exc:
                # Whether it committed is not known: not retried.
                state = "failed"
                if lost(exc, raw):
                    await self._drop_idle()
                raise conn.translated(exc, "COMMIT", None) from exc
            state = "committed"
            for action in conn.on_commit:
                try:
                    action()
                except Exception:
                    # A count or a log line: the transaction committed whatever it does.
                    log.exception("an action after a commit failed")
            return result
        finally:
            if conn.in_pipeline:
                state = "interrupted"
            elif conn.stale:
                state = "stale"
            await self._checkin(raw, generation, state)

    async def _checkout(self) -> tuple[psycopg.AsyncConnection[Any], int]:
        if self._closed:
            raise RuntimeError("the hot path's connections are closed")
        generation = self._generation
        if self._idle:
            return self._idle.pop(), generation
        try:
            raw = await psycopg.AsyncConnection.connect(
                self._conninfo, row_factory=namedtuple_row, **self._connect_args
            )
        except psycopg.Error as exc:
            raise DBAPIError.instance(
                None, None, exc, psycopg.Error, connection_invalidated=True, dialect=self.dialect
            ) from exc
        # Statements are prepared here (`DirectConnection._sent`), never by
        # psycopg, whose rollback would deallocate them all.
        self._sessions[raw] = _Session(raw.info.encoding, threshold=raw.prepare_threshold)
        raw.prepare_threshold = None
        return raw, generation

    async def _checkin(
        self, raw: psycopg.AsyncConnection[Any], generation: int, state: str
    ) -> None:
        reusable = False
        try:
            if state != "interrupted" and not (raw.closed or raw.broken):
                if state in ("failed", "stale"):
                    # Rolled back even when it is to be closed: its backend's
                    # locks go now, not once it notices the connection gone.
                    await raw.rollback()
                reusable = state != "stale"
        except psycopg.Error:
            pass
        finally:
            # Cancelled during its rollback, a connection is closed too.
            if reusable and generation == self._generation and not self._closed:
                self._idle.append(raw)
            else:
                await raw.close()

    async def _drop_idle(self) -> None:
        self._generation += 1
        idle, self._idle = self._idle, []
        for raw in idle:
            await raw.close()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for raw in idle:
            await raw.close()


# What the store's hot-path readers and writers are given: the engine's
# connection, or one of these.
LedgerConnection = AsyncConnection | DirectConnection


def current_transaction(conn: LedgerConnection) -> object | None:
    """An object that is this transaction's for as long as it lasts (to tell a
    write of this transaction from an earlier one's)."""
    if isinstance(conn, DirectConnection):
        return conn
    return conn.sync_connection.get_transaction() if conn.sync_connection else None


def engine_connection(conn: LedgerConnection) -> AsyncConnection:
    """`conn`, for a store part the hot path never reaches (intake, endpoints)."""
    assert isinstance(conn, AsyncConnection), "this write goes through the ledger engine"
    return conn


def direct_connections_for(
    url: str, dialect: Dialect, pooler: Pooler = "none"
) -> DirectConnections | None:
    """The hot path's connections on PostgreSQL; None on SQLite, whose
    transactions take BEGIN IMMEDIATE on the ledger engine."""
    return DirectConnections(url, dialect, pooler) if dialect.name == "postgresql" else None
