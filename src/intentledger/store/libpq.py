"""A command's results read straight from a psycopg connection's libpq.

For the statements sent often enough that psycopg's cursor costs more than
the statement itself: intake's group statement (store/group_statement.py)
and the worker's hot path (store/direct.py). psycopg makes and closes the
connection; a command is sent through its libpq layer (`psycopg.pq`), the way
psycopg's own generators drive libpq, and its results are read here with one
readiness wait on the event loop at a time. A cursor's execute also made a
cursor, converted the query and its values, asked its prepared-statement
cache, polled the socket for writing and set and cancelled a timer on every
wait (docs/benchmarks.md, "The group statement through libpq" and "The hot
path's statements through libpq").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.pq.abc import PGresult
from psycopg.waiting import Ready, Wait

log = logging.getLogger(__name__)

# How long a cancelled statement's cancel request may take (psycopg's own bound).
CANCEL_TIMEOUT_SECONDS = 5.0

# A command that ran: rows, none, or an empty text (which psycopg takes too).
_ANSWERED = frozenset({ExecStatus.COMMAND_OK, ExecStatus.TUPLES_OK, ExecStatus.EMPTY_QUERY})
# What a COPY would answer: libpq hands it back on every call, never ending.
_COPY = frozenset({ExecStatus.COPY_IN, ExecStatus.COPY_OUT, ExecStatus.COPY_BOTH})


async def results(conn: psycopg.AsyncConnection[Any]) -> list[PGresult]:
    """Every result of the command just sent, once libpq has sent it all and
    read its end. libpq's own reads block the thread while the connection is
    busy, so each result is taken only once it is not, as psycopg's
    generators take them. A task cancelled meanwhile asks the server to
    cancel the command too, as psycopg does (the connection is then in no
    state to reuse: its caller closes it)."""
    try:
        return await _results(conn)
    except asyncio.CancelledError:
        await cancel_on_the_server(conn)
        raise


async def _results(conn: psycopg.AsyncConnection[Any]) -> list[PGresult]:
    pgconn = conn.pgconn
    loop = asyncio.get_running_loop()
    while pgconn.flush():
        # libpq's rule for a send that must wait: read what the server sends
        # meanwhile, or each side may wait for the other.
        if await ready(loop, pgconn.socket, Wait.RW) & Ready.R:
            pgconn.consume_input()
    got: list[PGresult] = []
    while True:
        while pgconn.is_busy():
            await ready(loop, pgconn.socket, Wait.R)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            return got
        if result.status in _COPY:
            raise psycopg.ProgrammingError("a statement sent through libpq cannot be a COPY")
        got.append(result)


async def pipelined(conn: psycopg.AsyncConnection[Any]) -> list[list[PGresult]]:
    """The results of each command sent in pipeline mode, up to the
    synchronisation point sent after them (libpq's `PQpipelineSync`), read as
    `results` reads one command's: a command the server skipped after an
    earlier one failed answers PIPELINE_ABORTED."""
    try:
        return await _pipelined(conn)
    except asyncio.CancelledError:
        await cancel_on_the_server(conn)
        raise


async def _pipelined(conn: psycopg.AsyncConnection[Any]) -> list[list[PGresult]]:
    pgconn = conn.pgconn
    loop = asyncio.get_running_loop()
    while pgconn.flush():
        if await ready(loop, pgconn.socket, Wait.RW) & Ready.R:
            pgconn.consume_input()
    answers: list[list[PGresult]] = []
    answer: list[PGresult] = []
    while True:
        while pgconn.is_busy():
            await ready(loop, pgconn.socket, Wait.R)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            # The end of one command's results. Every command has one at
            # least, so two ends in a row is a connection libpq gave up on
            # without a word: reading on would spin.
            if not answer:
                raise psycopg.OperationalError("a pipeline's answers ended before its end")
            answers.append(answer)
            answer = []
            continue
        if result.status == ExecStatus.PIPELINE_SYNC:
            return answers
        if result.status in _COPY:
            raise psycopg.ProgrammingError("a statement sent through libpq cannot be a COPY")
        answer.append(result)


def first_failure(conn: psycopg.AsyncConnection[Any], got: list[PGresult]) -> psycopg.Error | None:
    """psycopg's exception for the first result that failed, as a cursor raises it."""
    for result in got:
        if result.status not in _ANSWERED:
            return psycopg.errors.error_from_result(result, encoding=conn.info.encoding)
    return None


async def ready(loop: asyncio.AbstractEventLoop, socket: int, wait: Wait) -> Ready:
    """Until the connection's socket is ready for what `wait` asks: which it
    is ready for. A socket the loop cannot watch (closed under it) is
    psycopg's `OperationalError`, as psycopg's own wait makes it."""
    waiting: asyncio.Future[Ready] = loop.create_future()
    reading, writing = bool(wait & Wait.R), bool(wait & Wait.W)
    try:
        if reading:
            loop.add_reader(socket, _wake, waiting, Ready.R)
        if writing:
            loop.add_writer(socket, _wake, waiting, Ready.W)
        return await waiting
    except OSError as exc:
        raise psycopg.OperationalError("connection socket closed") from exc
    finally:
        if reading:
            loop.remove_reader(socket)
        if writing:
            loop.remove_writer(socket)


def _wake(waiting: asyncio.Future[Ready], state: Ready) -> None:
    # The socket stays ready until the waiting task runs and stops watching it.
    if not waiting.done():
        waiting.set_result(state)


async def cancel_on_the_server(conn: psycopg.AsyncConnection[Any]) -> None:
    """psycopg's rule for a query whose task is cancelled: the server is asked
    to cancel it too. Closing the connection alone would not stop it: a
    backend waiting on a lock notices its client gone only once it has the
    lock, and then commits what it was sent (tests/test_group_statement.py)."""
    if conn.pgconn.transaction_status != TransactionStatus.ACTIVE:
        return
    try:
        await conn.cancel_safe(timeout=CANCEL_TIMEOUT_SECONDS)
    except Exception as exc:
        log.warning("cancelling a statement on the server failed: %s", exc)
