"""Engines for the two supported databases, configured for the ledger's needs."""

from __future__ import annotations

import re
from typing import Any, Literal
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

SQLITE_BUSY_TIMEOUT_MS = 30_000

# What stands between us and PostgreSQL. "pgbouncer": a pooler in transaction
# mode, which hands each transaction whichever server connection is free.
Pooler = Literal["none", "pgbouncer"]


class UnsupportedDatabase(ValueError):
    pass


def parse_url(url: str) -> URL:
    """`url` as SQLAlchemy reads it. libpq's multi-host form,
    `postgresql://user@h1:p1,h2:p2/db?target_session_attrs=read-write` (the
    service follows whichever host is the primary), is not one SQLAlchemy
    parses: it becomes its own spelling of the same, one `host=h:p` query
    parameter per host, which its psycopg dialect hands to libpq whole."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        try:
            return make_url(url)
        except (ArgumentError, ValueError) as exc:
            # Not the parser's words: they may quote the URL, password and all.
            raise UnsupportedDatabase(
                f"database URL {_redacted(url)} cannot be read ({type(exc).__name__})"
            ) from None
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name == "host" for name, _ in query):
        raise UnsupportedDatabase(
            f"database URL {_redacted(url)}: name the hosts once, as h1:p1,h2:p2 or as "
            "host= parameters, not both"
        )
    if any(not host.strip() for host in hosts.split(",")):
        raise UnsupportedDatabase(f"database URL {_redacted(url)}: an empty host in {hosts!r}")
    unnamed = [host for host in hosts.split(",") if not _NAMED_HOST.fullmatch(host)]
    if unnamed:
        # SQLAlchemy splits each entry at its colons: an IPv6 literal would be
        # cut into pieces and a node silently dropped. Refused, not guessed.
        raise UnsupportedDatabase(
            f"database URL {_redacted(url)}: {', '.join(map(repr, unnamed))} is not a host "
            "name or IPv4 address with an optional :port; in a URL naming several hosts, "
            "name each so (an IPv6 address or a socket directory needs a host name there)"
        )
    query += [("host", host) for host in hosts.split(",")]
    return make_url(f"{parts.scheme}://{userinfo}{at}{parts.path}?{urlencode(query)}")


# A host of a multi-host URL: a name or IPv4 address, and an optional port.
_NAMED_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(:[0-9]{1,5})?")


def _redacted(url: str) -> str:
    """`url` with any password hidden, for an error message."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, _password = userinfo.partition(":")
    return urlunsplit(parts._replace(netloc=user + (colon and ":***") + at + hosts))


def hosts_of(url: str) -> tuple[str, ...]:
    """The `host:port` (or `host`) entries a PostgreSQL URL names, in order."""
    parsed = parse_url(url)
    many = parsed.query.get("host")
    if many:
        return (many,) if isinstance(many, str) else tuple(many)
    if parsed.host is None:
        return ()
    return (f"{parsed.host}:{parsed.port}" if parsed.port else parsed.host,)


def dialect_of(url: str) -> str:
    name = parse_url(url).get_backend_name()
    if name not in ("sqlite", "postgresql"):
        raise UnsupportedDatabase(
            f"unsupported database URL {_redacted(url)!r}: use sqlite:///FILE or postgresql://..."
        )
    return name


def require_utf8(url: str) -> None:
    """Refuse a PostgreSQL database that does not store text as UTF-8.

    On a SQL_ASCII database psycopg hands text back as bytes and the server
    accepts any byte sequence: nothing else would work, and the first failure
    would be an obscure one deep in SQLAlchemy. Checked with a bare psycopg
    connection, before any of that, at `migrate` and at start-up.
    """
    if dialect_of(url) != "postgresql":
        return
    import psycopg

    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        row = conn.execute("SHOW server_encoding").fetchone()
    encoding = row[0] if row is not None else None
    if isinstance(encoding, bytes):
        encoding = encoding.decode("ascii", "replace")
    if encoding != "UTF8":
        raise UnsupportedDatabase(
            f"the database's encoding is {encoding}, not UTF8: create it with "
            "ENCODING 'UTF8' (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0, "
            "or a cluster made by initdb -E UTF8)"
        )


def libpq_url(url: str) -> str:
    """The URL as libpq reads it (`postgresql://`, no SQLAlchemy driver name;
    several hosts in libpq's own h1:p1,h2:p2 form)."""
    parsed = parse_url(url).set(drivername="postgresql")
    hosts = parsed.query.get("host")
    if not hosts or isinstance(hosts, str):
        return parsed.render_as_string(hide_password=False)
    userinfo = ""
    if parsed.username is not None:
        userinfo = quote(parsed.username, safe="")
        if parsed.password is not None:
            userinfo += ":" + quote(str(parsed.password), safe="")
        userinfo += "@"
    rest = urlencode([(name, value) for name, value in _query_items(parsed) if name != "host"])
    return f"postgresql://{userinfo}{','.join(hosts)}/{parsed.database or ''}" + (
        f"?{rest}" if rest else ""
    )


def _query_items(parsed: URL) -> list[tuple[str, str]]:
    return [
        (name, value)
        for name, values in parsed.query.items()
        for value in ((values,) if isinstance(values, str) else values)
    ]


def async_url(url: str) -> str:
    """`sqlite:///x.db` -> aiosqlite, `postgresql://` -> psycopg 3 (async)."""
    parsed = parse_url(url)
    driver = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+psycopg"}[dialect_of(url)]
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def sync_url(url: str) -> str:
    parsed = parse_url(url)
    driver = {"sqlite": "sqlite", "postgresql": "postgresql+psycopg"}[dialect_of(url)]
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def _configure_sqlite(sync_engine: Engine) -> None:
    """WAL, full fsync, a long busy timeout and BEGIN IMMEDIATE.

    Every ledger transaction takes the write lock up front: SQLite's default
    deferred BEGIN upgrades read locks late and fails with "database is locked"
    when two processes do so at once, instead of waiting its turn.
    """

    @event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(sync_engine, "begin")
    def _on_begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def connect_args(url: str, pooler: Pooler) -> dict[str, Any]:
    """psycopg's arguments for a connection behind `pooler`.

    psycopg prepares a statement on the server after its fifth use on a
    connection. Behind a pooler in transaction mode the next transaction may
    run on another server connection, where that name is missing or names
    another query: PgBouncer 1.18 then raised errors and, worse, returned
    another query's rows with no error at all. With a pooler nothing is
    prepared; nothing else the ledger does keeps session state (no LISTEN,
    no session settings, no session-level advisory locks, no temporary
    tables: what it locks or sets lasts one transaction).
    """
    if pooler == "none":
        return {}
    if dialect_of(url) != "postgresql":
        raise UnsupportedDatabase(f"a {pooler} pooler needs a postgresql:// database URL")
    return {"prepare_threshold": None}


# SQLSTATEs after which a pooled connection is worth nothing, though psycopg
# may still call it open: 25006, a write refused because the node is (now) a
# read-only standby; 57P01-57P03, a server shutting down, crashed or not yet
# accepting connections; class 08, the connection itself failing.
_CONNECTION_LOST_STATES = frozenset({"25006", "57P01", "57P02", "57P03"})


def _count_lost_nodes_as_disconnects(sync_engine: Engine) -> None:
    """Treat a node that went away or stopped taking writes as a disconnect.

    After a failover the old primary may come back as a standby while a pooled
    connection to it stays open: every write on it is refused with 25006,
    which SQLAlchemy reports as a plain error, so the pool would hand the same
    connection out again and the API would answer 500 until it was recycled.
    Counted as a disconnect, SQLAlchemy drops the whole pool: the next
    connection goes through the URL's host list again, and
    `target_session_attrs=read-write` finds the new primary; meanwhile the
    error reaches the API as an invalidated connection, a 503 with
    Retry-After, which the client retries with the same key. The ledger never
    sets a session or transaction read-only itself, so a 25006 always means
    the node, not the request.
    """

    @event.listens_for(sync_engine, "handle_error")
    def _on_error(context: Any) -> None:
        if _lost_state(getattr(context.original_exception, "sqlstate", None) or ""):
            context.is_disconnect = True


def _lost_state(sqlstate: str) -> bool:
    return sqlstate in _CONNECTION_LOST_STATES or sqlstate.startswith("08")


def lost_connection(exc: BaseException) -> bool:
    """Did `exc` come from a connection that was lost, a node gone or one no
    longer taking writes (a restart or failover), rather than from what was
    asked of it? For log lines: the one kind is expected, the other a bug."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, InterfaceError | ConnectionError | PoolTimeout):
        return True
    original = exc.orig if isinstance(exc, DBAPIError) else exc
    sqlstate = str(getattr(original, "sqlstate", None) or "")
    if isinstance(exc, OperationalError) and not sqlstate:
        # No SQLSTATE: the connection failed before the server could say why.
        return True
    return _lost_state(sqlstate)


def create_ledger_engine(url: str, *, pool_size: int = 10, pooler: Pooler = "none") -> AsyncEngine:
    arguments = connect_args(url, pooler)
    if dialect_of(url) == "sqlite":
        engine = create_async_engine(async_url(url))
        _configure_sqlite(engine.sync_engine)
        return engine
    engine = create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        connect_args=arguments,
    )
    _count_lost_nodes_as_disconnects(engine.sync_engine)
    return engine


def create_sync_engine(url: str, *, pooler: Pooler = "none") -> Engine:
    engine = create_engine(sync_url(url), connect_args=connect_args(url, pooler))
    if dialect_of(url) == "sqlite":
        _configure_sqlite(engine)
    else:
        _count_lost_nodes_as_disconnects(engine)
    return engine


async def ping(conn: AsyncConnection) -> None:
    """Raise unless the database answers a trivial query."""
    await conn.execute(text("SELECT 1"))
