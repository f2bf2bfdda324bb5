"""The libraries' floor: what aiohttp, psycopg and SQLAlchemy cost in CPU when
they do a payment's work and nothing else (issue 39).

python -m intentledger_tools.bench.library_floor sql --script dispatch-batch.pgbench \\
    --driver psycopg|sqlalchemy --clients K [--database-url URL] [--signalled]
python -m intentledger_tools.bench.library_floor together --script dispatch-batch.pgbench \\
    --clients K --url BASE --concurrency C [--domain] [--warmup W] [--database-url URL] \\
    [--signalled]
python -m intentledger_tools.bench.library_floor http --url BASE --calls N \\
    --concurrency C [--warmup W] [--signalled]

A worker written in Python on these libraries cannot do less than send the
statements of a delivery and make the provider call; this process does only
that, on uvloop as our processes run (`intentledger.eventloop`), with none of
intentledger's code on the path (no domain, no tasks, no settlement queue).

- `sql` replays the bench's recorded batch script (`dispatch-batch.pgbench`,
  rendered from the real code path's statements) over the seeded ACCEPTED
  payments, with K connections in one asyncio process, until no due outbox
  row is left, as pgbench runs it: each `BEGIN` ... `COMMIT` block one
  transaction, a statement ending in `\\gset` storing its one row's columns as
  variables, `:name` replaced by a bound parameter only where `name` is a
  known variable (so `::text` casts stay), and `\\startpipeline` ...
  `\\endpipeline` sent in psycopg's pipeline mode. Bound parameters let psycopg
  prepare a statement after its fifth use, as our code path does (pgbench
  runs with `-M prepared`). With `--driver psycopg`, psycopg's
  `AsyncConnection` alone; with `--driver sqlalchemy`, SQLAlchemy Core's async
  engine over psycopg with our store's pool options, a transaction per block
  (`engine.begin()`, a pooled connection pinged at checkout) and
  `exec_driver_sql`. Every row a statement returns is fetched, as our code
  reads them.
- `together` is `sql` through psycopg with each claim's charge calls (as
  `http` makes them, to the stand-in at URL) made between the script's
  pre-submit and its record, where a worker makes them: the two libraries
  in one event loop, a task per call, at most C calls in flight (a
  worker's concurrency, as `http` makes them). What it costs beyond `sql`
  and `http` measured apart is what running them together costs, before any
  code of ours. With `--domain`, each claim's pure work too
  (bench/domain_cost.py), in the same loop, where a worker does it: the
  libraries and the domain with none of our glue, what the workers' CPU
  ratio would read if they did nothing else.
- `http` makes N charge calls as the worker's sandbox adapter sends them
  (`POST /v1/charges`, the same headers with a fresh `Idempotency-Key`, the
  same JSON body) with plain aiohttp configured as our provider client
  (connector, session options, orjson for bodies), C at a time, each answer
  read whole and parsed, after a warm-up.

With `--signalled` (how the bench runs it) the process connects (and warms
up), prints `library_floor ready`, waits for SIGUSR1, does the measured work,
prints its result and stays until it is ended: the bench reads its CPU (and
the server's) from /proc around the work alone, as it does for every role
(a process that has exited shows none). The
result is one line, `library_floor {json}`: what was done, the wall seconds
and the process's own CPU seconds (`time.process_time()`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import signal
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

READY = "library_floor ready"
RESULT_PREFIX = "library_floor "

# pgbench reads a variable's name as the letters, digits, underscores (and
# non-ASCII bytes) after a colon; a colon followed by another is no variable.
_VARIABLE_NAME = re.compile(r"[A-Za-z0-9_\u0080-\U0010ffff]+")

# What the worker's sandbox adapter sends for a charge (providers/sandbox_client.py)
# and our provider client sends with every call (providers/http.py).
CHARGE_PATH = "/v1/charges"
SESSION_HEADERS = {"Accept": "application/json", "User-Agent": "intentledger"}
CHARGE_BODY = {"amount": 1250, "currency": "EUR", "payment_method": "pm_ok", "metadata": {}}
IDLE_CONNECTION_SECONDS = 4.0
DEFAULT_PROVIDER_CONNECTIONS = 200
CALL_TIMEOUT_SECONDS = 10.0
# Our store's pool (store/database.py, create_ledger_engine).
POOL_SIZE = 10


class ScriptError(ValueError):
    """A script this replay cannot run as pgbench would."""


class ReplayError(RuntimeError):
    """The replay did not leave the ledger as the script's work must."""


# -- the script --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Statement:
    text: str  # as written, `:name` not yet replaced, no trailing `;`
    gset: bool = False


@dataclass(frozen=True)
class Pipeline:
    statements: tuple[Statement, ...]


Step = Statement | Pipeline


@dataclass(frozen=True)
class Block:
    """One `BEGIN` ... `COMMIT` of the script: one transaction."""

    steps: tuple[Step, ...]


def parse_script(text: str) -> list[Block]:
    """The script's transaction blocks. A statement runs to the line ending in
    `;` or `\\gset`; `BEGIN;`/`COMMIT;` delimit the blocks; the only other
    meta-commands understood are `\\startpipeline` and `\\endpipeline`."""
    blocks: list[Block] = []
    steps: list[Step] | None = None
    pipeline: list[Statement] | None = None
    pending: list[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("--")):
            continue
        where = f"line {number}"
        if not pending and line.startswith("\\"):
            command = line.split()[0]
            if command == "\\startpipeline":
                if steps is None or pipeline is not None:
                    raise ScriptError(f"{where}: \\startpipeline outside a block or inside one")
                pipeline = []
            elif command == "\\endpipeline":
                if steps is None or pipeline is None:
                    raise ScriptError(f"{where}: \\endpipeline without \\startpipeline")
                steps.append(Pipeline(tuple(pipeline)))
                pipeline = None
            else:
                raise ScriptError(f"{where}: the meta-command {command} is not supported")
            continue
        pending.append(line)
        gset = line.endswith("\\gset")
        if not (gset or line.endswith(";")):
            continue
        statement = " ".join(pending)
        pending = []
        statement = statement.removesuffix("\\gset").rstrip() if gset else statement[:-1].rstrip()
        keyword = statement.upper()
        if keyword in ("BEGIN", "START TRANSACTION"):
            if steps is not None:
                raise ScriptError(f"{where}: BEGIN inside a block")
            steps = []
        elif keyword in ("COMMIT", "END"):
            if steps is None or pipeline is not None:
                raise ScriptError(f"{where}: COMMIT outside a block or inside a pipeline")
            blocks.append(Block(tuple(steps)))
            steps = None
        elif steps is None:
            raise ScriptError(f"{where}: a statement outside BEGIN ... COMMIT")
        elif pipeline is not None:
            if gset:
                raise ScriptError(f"{where}: \\gset inside a pipeline")
            pipeline.append(Statement(statement))
        else:
            steps.append(Statement(statement, gset))
    if pending or steps is not None:
        raise ScriptError("the script ends inside a statement or a block")
    if not blocks:
        raise ScriptError("the script holds no BEGIN ... COMMIT block")
    return blocks


def bind(text: str, known: Collection[str]) -> tuple[str, tuple[str, ...]]:
    """`text` as a psycopg query: every `:name` whose name is a known variable
    a named placeholder, every other character as it was (a literal `%`
    doubled); and the variables it names, each once."""
    out: list[str] = []
    names: dict[str, None] = {}
    at = 0
    while (colon := text.find(":", at)) >= 0:
        out.append(text[at:colon].replace("%", "%%"))
        name = _VARIABLE_NAME.match(text, colon + 1)
        if name is None:
            # A run of colons (`::text`): pgbench skips them all.
            end = colon
            while end < len(text) and text[end] == ":":
                end += 1
            out.append(text[colon:end])
            at = end
            continue
        if name.group() in known:
            out.append(f"%({name.group()})s")
            names[name.group()] = None
        else:
            out.append(":" + name.group().replace("%", "%%"))
        at = name.end()
    out.append(text[at:].replace("%", "%%"))
    return "".join(out), tuple(names)


class Binder:
    """Each statement of a script as a query for the variables known so far,
    made once per set of variables (the set stays the same from one run of the
    script to the next)."""

    def __init__(self) -> None:
        self.known: frozenset[str] = frozenset()
        self._queries: dict[int, tuple[str, tuple[str, ...]]] = {}

    def learn(self, names: Collection[str]) -> None:
        if not self.known.issuperset(names):
            self.known = self.known | frozenset(names)
            self._queries.clear()

    def query(self, statement: Statement) -> tuple[str, tuple[str, ...]]:
        key = id(statement)
        found = self._queries.get(key)
        if found is None:
            found = self._queries[key] = bind(statement.text, self.known)
        return found


# -- the sql replay ----------------------------------------------------------------------------


class Session(Protocol):
    """One client's connection: runs a block as one transaction and returns
    the row of its `\\gset` statement (None if it has none)."""

    async def run(self, block: Block, variables: dict[str, Any]) -> dict[str, Any] | None: ...

    async def execute(self, query: str, params: dict[str, Any]) -> None: ...


def _parameters(names: tuple[str, ...], variables: dict[str, Any]) -> dict[str, Any]:
    return {name: variables[name] for name in names}


def _gset_row(rows: Sequence[Any], columns: Sequence[str]) -> dict[str, Any]:
    if len(rows) != 1:
        raise ReplayError(f"a \\gset statement returned {len(rows)} rows, not one")
    return dict(zip(columns, rows[0], strict=True))


class PsycopgSession:
    def __init__(self, conn: Any, binder: Binder) -> None:
        self.conn = conn
        self.binder = binder

    async def run(self, block: Block, variables: dict[str, Any]) -> dict[str, Any] | None:
        conn, gset = self.conn, None
        # Not in autocommit: the first statement begins the transaction, as psycopg does.
        for step in block.steps:
            if isinstance(step, Pipeline):
                async with conn.pipeline():
                    cursors = []
                    for statement in step.statements:
                        query, names = self.binder.query(statement)
                        cursors.append(await conn.execute(query, _parameters(names, variables)))
                for cursor in cursors:
                    if cursor.description is not None:
                        await cursor.fetchall()
                continue
            query, names = self.binder.query(step)
            cursor = await conn.execute(query, _parameters(names, variables))
            rows = await cursor.fetchall() if cursor.description is not None else []
            if step.gset:
                gset = _gset_row(rows, [c.name for c in cursor.description or ()])
        await conn.commit()
        return gset

    async def execute(self, query: str, params: dict[str, Any]) -> None:
        await self.conn.execute(query, params)
        await self.conn.commit()


class SqlAlchemySession:
    def __init__(self, engine: Any, binder: Binder) -> None:
        self.engine = engine
        self.binder = binder

    async def run(self, block: Block, variables: dict[str, Any]) -> dict[str, Any] | None:
        gset = None
        # A pooled connection per transaction, as our store takes one.
        async with self.engine.begin() as conn:
            for step in block.steps:
                if isinstance(step, Pipeline):
                    # What an executemany sends: psycopg's pipeline, under SQLAlchemy's
                    # transaction (the script spells each parameter set out as its own text).
                    raw = await conn.get_raw_connection()
                    driver = raw.driver_connection
                    async with driver.pipeline():
                        cursors = []
                        for statement in step.statements:
                            query, names = self.binder.query(statement)
                            params = _parameters(names, variables)
                            cursors.append(await driver.execute(query, params))
                    for cursor in cursors:
                        if cursor.description is not None:
                            await cursor.fetchall()
                    continue
                query, names = self.binder.query(step)
                result = await conn.exec_driver_sql(query, _parameters(names, variables))
                rows = result.fetchall() if result.returns_rows else []
                if step.gset:
                    gset = _gset_row(rows, list(result.keys()))
        return gset

    async def execute(self, query: str, params: dict[str, Any]) -> None:
        async with self.engine.begin() as conn:
            await conn.exec_driver_sql(query, params)


@dataclass
class Progress:
    """What the clients have done together (one process, one event loop)."""

    unclaimed: int  # due rows no client holds
    payments: int = 0
    scripts: int = 0
    empty_claims: int = 0
    partial_claims: int = 0


def claimed_rows(row: dict[str, Any]) -> list[Any]:
    """The outbox row ids a dispatch script's claim handed on (`id_1`...)."""
    return [value for name, value in row.items() if name.startswith("id_") and value is not None]


# A partial claim's rows go back to the queue at once, due before anything else.
RELEASE = "UPDATE outbox SET due_at = '-infinity' WHERE id = ANY(%(ids)s)"
# After a claim short of rows, a client waits about this long before it claims again.
PARTIAL_CLAIM_PAUSE_SECONDS = 0.005


# Run before a script's last block (the record) with the claim's variables:
# the `together` mode's provider calls.
BeforeRecord = Callable[[dict[str, Any]], Awaitable[None]]


async def replay_client(
    session: Session,
    blocks: list[Block],
    binder: Binder,
    batch: int,
    progress: Progress,
    before_record: BeforeRecord | None = None,
) -> None:
    """Run the script over and over until no due row is left unclaimed.

    The first block is the claim. A claim that found fewer rows than the script
    names (clients claiming at once, near the end) cannot run the rest, which
    names every row: its rows are released and claimed again whole. (pgbench
    with `-t` stops after a fixed count and would run such a script on.) A
    client stops once every row is claimed: what the others hold they finish.
    `before_record` runs between the last two blocks (the pre-submit and the
    record), where a worker makes its calls.
    """
    claim, *rest = blocks
    while progress.unclaimed > 0:
        variables: dict[str, Any] = {}
        row = await session.run(claim, variables)
        if row is None:
            raise ScriptError("the script's first block must end its claim with \\gset")
        ids = claimed_rows(row)
        if len(ids) < batch:
            if ids:
                progress.partial_claims += 1
                await session.execute(RELEASE, {"ids": ids})
            else:
                progress.empty_claims += 1  # another client holds rows it will release
            # Apart, lest two clients split the same rows again.
            await asyncio.sleep(PARTIAL_CLAIM_PAUSE_SECONDS * (0.5 + random.random()))
            continue
        progress.unclaimed -= batch
        binder.learn(row)
        variables.update(row)
        for number, block in enumerate(rest, start=1):
            if before_record is not None and number == len(rest):
                await before_record(variables)
            await session.run(block, variables)
        progress.payments += batch
        progress.scripts += 1


def script_batch(blocks: list[Block]) -> int:
    """How many rows the script's claim hands on (its `id_k` variables)."""
    claim = blocks[0].steps[0] if blocks and blocks[0].steps else None
    if not isinstance(claim, Statement) or not claim.gset:
        raise ScriptError("the script's first block must be the claim, ending in \\gset")
    batch = len(set(re.findall(r"\bAS (id_\d+)\b", claim.text)))
    if not batch:
        raise ScriptError("the script's claim hands on no id_k variables")
    return batch


async def wait_for_signal(signum: int) -> Callable[[], Any]:
    """An awaitable factory for `signum`, its handler set now (before `ready` is said)."""
    event = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signum, event.set)
    return event.wait


def say(line: str) -> None:
    print(line, flush=True)


async def sql_floor(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg
    from sqlalchemy.ext.asyncio import create_async_engine

    from intentledger.store.database import async_url, libpq_url

    blocks = parse_script(args.script_text)
    batch = script_batch(blocks)
    go = await wait_for_signal(signal.SIGUSR1) if args.signalled else None
    libpq = libpq_url(args.database_url)
    with psycopg.connect(libpq, autocommit=True) as admin:
        due = _count(admin, "SELECT count(*) FROM outbox WHERE done_at IS NULL")
    if due == 0 or due % batch:
        raise ReplayError(
            f"{due} undelivered outbox rows: the replay needs a positive multiple of the "
            f"script's {batch} rows per claim"
        )
    binders = [Binder() for _ in range(args.clients)]
    sessions: list[Session]
    conns: list[Any] = []
    engine = None
    if args.driver == "psycopg":
        conns = [await psycopg.AsyncConnection.connect(libpq) for _ in range(args.clients)]
        sessions = [PsycopgSession(c, b) for c, b in zip(conns, binders, strict=True)]
    else:
        # Our store's engine options (store/database.py): the pool size doubled by its
        # overflow, a ping at every checkout. Its error listener costs nothing per transaction.
        size = max(POOL_SIZE, args.clients)
        engine = create_async_engine(
            async_url(args.database_url), pool_size=size, max_overflow=size, pool_pre_ping=True
        )
        await _fill_pool(engine, args.clients)
        sessions = [SqlAlchemySession(engine, b) for b in binders]
    progress = Progress(unclaimed=due)
    provider = None
    pure: PureWork | None = None
    before_record: BeforeRecord | None = None
    if args.mode == "together":
        # Each claim's calls at once, as a worker starts them after its
        # pre-submit: a task each (asyncio.gather's), as many in flight as a
        # worker's concurrency allows (the `http` floor's), the rest waiting
        # for a free one, as a worker's claims wait for free slots.
        provider = provider_session(args.concurrency)
        url = args.url.rstrip("/") + CHARGE_PATH
        free = asyncio.Semaphore(args.concurrency)

        async def limited(operation_id: str) -> None:
            async with free:
                await charge(provider, url, operation_id)

        async def calls(operation_ids: Sequence[str]) -> None:
            await asyncio.gather(*(limited(op) for op in operation_ids))

        names = [f"op_{k}" for k in range(1, batch + 1)]
        claim = blocks[0].steps[0]
        assert isinstance(claim, Statement)  # script_batch checked it
        if set(re.findall(r"\bAS (op_\d+)\b", claim.text)) != set(names):
            raise ScriptError(f"the claim must hand on {names[0]}..{names[-1]} to call with")

        async def claim_calls(variables: dict[str, Any]) -> None:
            await calls([variables[name] for name in names])

        before_record = claim_calls
    try:
        if args.mode == "together" and args.domain:
            # Inside the `try`: its warm-up can fail, and the connections must close.
            before_record = pure = PureWork(calls, names, batch)
        if provider is not None:
            keys = list(charge_keys(args.warmup))
            for start in range(0, len(keys), args.concurrency):
                await calls(keys[start : start + args.concurrency])
        if go is not None:
            say(READY)
            await go()
        wall, cpu = time.monotonic(), time.process_time()
        clients = zip(sessions, binders, strict=True)
        await asyncio.gather(
            *(replay_client(s, blocks, b, batch, progress, before_record) for s, b in clients)
        )
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    finally:
        for conn in conns:
            await conn.close()
        if engine is not None:
            await engine.dispose()
        if provider is not None:
            await provider.close()
    with psycopg.connect(libpq, autocommit=True) as admin:
        left = _count(admin, "SELECT count(*) FROM outbox WHERE done_at IS NULL")
    if left:
        raise ReplayError(f"the replay left {left} of {due} outbox rows undelivered")
    result = {
        "mode": args.mode,
        "driver": args.driver,
        "clients": args.clients,
        "payments": progress.payments,
        "scripts": progress.scripts,
        "empty_claims": progress.empty_claims,
        "partial_claims": progress.partial_claims,
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
    }
    if args.mode == "together":
        result["domain"] = args.domain
        if pure is not None:
            result["domain_cpu_seconds"] = round(pure.cpu_seconds, 4)
    return await reported(result, args.signalled)


class PureWork:
    """A claim's calls with its pure work around them, in the same loop, where
    a worker does it: the pre-submit's (records from rows, attempts, requests,
    news) before the calls, the group record's (answers judged and settled,
    observation rows, news) after them, a group being the claim
    (bench/domain_cost.py). Every payment must settle plainly, or the run
    fails: a change of the domain that made this stop measuring the path would
    otherwise go unseen. `cpu_seconds`: the process's CPU in the pure work
    alone (each piece runs without an await, so no other task's work is
    counted; a young collection its allocations set off is)."""

    def __init__(
        self, calls: Callable[[Sequence[str]], Awaitable[None]], names: Sequence[str], batch: int
    ) -> None:
        # Imported here: the other modes load no domain.
        from datetime import timedelta

        from intentledger.domain.evidence import Limits
        from intentledger_tools.bench import domain_cost

        self._calls = calls
        self._names = names
        self._batch = batch
        self._domain = domain_cost
        # The rows as the claim's read returns them, one set made once: a
        # worker's rows come from psycopg, whose reading the replay already does.
        self._rows = [domain_cost.operation_row(number) for number in range(batch)]
        self._limits = Limits(timedelta(hours=1))
        self.cpu_seconds = 0.0
        # Once unmeasured, as domain_cost runs first: first calls' caches and
        # imports are not the work's.
        self._settle(self._domain.pre_submit(self._rows))
        self.cpu_seconds = 0.0

    async def __call__(self, variables: dict[str, Any]) -> None:
        started = time.process_time()
        prepared = self._domain.pre_submit(self._rows)
        self.cpu_seconds += time.process_time() - started
        await self._calls([variables[name] for name in self._names])
        self._settle(prepared)

    def _settle(self, prepared: Any) -> None:
        started = time.process_time()
        settled = self._domain.record(prepared, self._limits)
        self.cpu_seconds += time.process_time() - started
        if settled != self._batch:
            raise ReplayError(
                f"the pure work settled {settled} of a claim's {self._batch} payments"
            )


def _count(conn: Any, query: str) -> int:
    row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


async def _fill_pool(engine: Any, connections: int) -> None:
    """Open the pool's connections before the measured work, as a running worker has."""
    held = [await engine.connect() for _ in range(connections)]
    for conn in held:
        await conn.close()


# -- the http calls ----------------------------------------------------------------------------


def charge_keys(count: int) -> Iterator[str]:
    """Operation ids as ours are made ("op_" and 24 hex digits)."""
    for _ in range(count):
        yield "op_" + secrets.token_hex(12)


def provider_session(connections: int) -> Any:
    """An aiohttp session made as our provider client makes its own
    (providers/http.py, ProviderClient): pool, headers, timeouts, orjson."""
    import aiohttp
    import certifi
    import orjson

    connector = aiohttp.TCPConnector(
        limit=max(DEFAULT_PROVIDER_CONNECTIONS, connections),
        limit_per_host=0,
        keepalive_timeout=IDLE_CONNECTION_SECONDS,
        ssl=ssl.create_default_context(cafile=certifi.where()),
    )
    return aiohttp.ClientSession(
        connector=connector,
        headers=SESSION_HEADERS,
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=CALL_TIMEOUT_SECONDS,
            sock_connect=CALL_TIMEOUT_SECONDS,
            sock_read=CALL_TIMEOUT_SECONDS,
        ),
        cookie_jar=aiohttp.DummyCookieJar(),
        json_serialize_bytes=orjson.dumps,
        trust_env=False,
    )


async def charge(session: Any, url: str, operation_id: str) -> None:
    """One charge call as the sandbox adapter sends it, its answer read whole and parsed."""
    body = {"reference": operation_id, **CHARGE_BODY}
    headers = {"Idempotency-Key": f"{operation_id}:1"}
    async with session.request(
        "POST", url, json=body, headers=headers, allow_redirects=False
    ) as response:
        content = await response.read()
        status = response.status
    answer = json.loads(content)
    if status != 200 or "id" not in answer:
        raise ReplayError(f"the provider answered {status}: {content[:200]!r}")


async def http_floor(args: argparse.Namespace) -> dict[str, Any]:
    go = await wait_for_signal(signal.SIGUSR1) if args.signalled else None
    session = provider_session(args.concurrency)
    url = args.url.rstrip("/") + CHARGE_PATH

    async def calls(keys: list[str]) -> None:
        pending = iter(keys)

        async def caller() -> None:
            for key in pending:
                await charge(session, url, key)

        await asyncio.gather(*(caller() for _ in range(args.concurrency)))

    try:
        await calls(list(charge_keys(args.warmup)))
        keys = list(charge_keys(args.calls))
        if go is not None:
            say(READY)
            await go()
        wall, cpu = time.monotonic(), time.process_time()
        await calls(keys)
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    finally:
        await session.close()
    result = {
        "mode": "http",
        "calls": args.calls,
        "concurrency": args.concurrency,
        "wall_seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
    }
    return await reported(result, args.signalled)


async def reported(result: dict[str, Any], signalled: bool) -> dict[str, Any]:
    """Print the result line; signalled, stay until SIGTERM ends the process, so
    the bench reads its CPU after the work and before it exits."""
    say(RESULT_PREFIX + json.dumps(result))
    if signalled:
        await asyncio.Event().wait()
    return result


def result_of(output: str) -> dict[str, Any]:
    """The result line in a library_floor process's output."""
    for line in reversed(output.splitlines()):
        if line.startswith(RESULT_PREFIX + "{"):
            found: dict[str, Any] = json.loads(line.removeprefix(RESULT_PREFIX))
            return found
    raise ReplayError("no library_floor result in the output")


# -- the command -------------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser(
        prog="python -m intentledger_tools.bench.library_floor",
        description="the libraries' CPU floor for a payment's SQL and provider call",
    )
    out.add_argument(
        "--signalled",
        action="store_true",
        help="say `ready`, wait for SIGUSR1 before the measured work and SIGTERM after it",
    )
    modes = out.add_subparsers(dest="mode", required=True)
    sql = modes.add_parser("sql", help="replay a recorded dispatch batch script")
    sql.add_argument("--script", required=True, help="dispatch-batch.pgbench")
    sql.add_argument("--driver", choices=("psycopg", "sqlalchemy"), required=True)
    sql.add_argument("--clients", type=_positive, required=True)
    sql.add_argument(
        "--database-url",
        default=os.environ.get("INTENTLEDGER_DATABASE_URL"),
        help="postgresql:// URL (default: INTENTLEDGER_DATABASE_URL)",
    )
    together = modes.add_parser(
        "together",
        help="replay the batch script through psycopg with each claim's charge calls "
        "made between its pre-submit and its record, in one process",
    )
    together.add_argument("--script", required=True, help="dispatch-batch.pgbench")
    together.add_argument("--clients", type=_positive, required=True)
    together.add_argument("--url", required=True, help="the stand-in's base URL (its /_sandbox)")
    together.add_argument(
        "--concurrency", type=_positive, required=True, help="calls in flight at most"
    )
    together.add_argument("--warmup", type=int, default=300)
    together.add_argument(
        "--domain",
        action="store_true",
        help="with each claim's pure work (bench/domain_cost.py) around its calls",
    )
    together.add_argument(
        "--database-url",
        default=os.environ.get("INTENTLEDGER_DATABASE_URL"),
        help="postgresql:// URL (default: INTENTLEDGER_DATABASE_URL)",
    )
    together.set_defaults(driver="psycopg")
    http = modes.add_parser("http", help="charge calls to the provider stand-in")
    http.add_argument("--url", required=True, help="the stand-in's base URL (its /_sandbox)")
    http.add_argument("--calls", type=_positive, required=True)
    http.add_argument("--concurrency", type=_positive, required=True)
    http.add_argument("--warmup", type=int, default=300)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    import aiohttp
    import psycopg
    from sqlalchemy.exc import SQLAlchemyError

    from intentledger import eventloop

    args = parser().parse_args(argv)
    replays = args.mode in ("sql", "together")
    if replays:
        try:
            args.script_text = Path(args.script).read_text()
        except OSError as exc:
            parser().error(f"cannot read the script: {exc}")
    if replays and not args.database_url:
        parser().error("--database-url or INTENTLEDGER_DATABASE_URL is required")
    # Frozen as our workers freeze their start: the floor runs as they run.
    eventloop.freeze_what_starts_with_the_process()
    try:
        eventloop.run(sql_floor(args) if replays else http_floor(args))
    except (ScriptError, ReplayError, OSError) as exc:
        print(f"library_floor: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except (psycopg.Error, SQLAlchemyError, aiohttp.ClientError) as exc:
        # The server or the provider refused or failed: say which and how, no traceback.
        print(f"library_floor: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
