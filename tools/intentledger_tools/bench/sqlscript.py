"""Render recorded statements as pgbench scripts and as bulk loaders.

A recorded statement is rendered with psycopg's own client-side binding, so
every value reaches the server exactly as the code path sends it. Only the
values that must differ per row (the operation id, the idempotency key, the
outbox row id) become pgbench variables or per-row SQL expressions, also
inside a JSON parameter of rows (the batch statements send their rows so) and
inside a JSON value bound whole (a provider's answer names the operation).

pgbench reads `:name` (a colon, then a letter or underscore) as a variable
anywhere in a statement, quoted or not. Literals that contain such a sequence
(worker ids like `worker:host:pid`) are rewritten as escape strings with the
colon spelled `\\x3a`, which the server reads back as the same text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from intentledger_tools.bench.capture import Statement

_PGBENCH_VARIABLE = re.compile(r":(?=[A-Za-z_])")


@dataclass(frozen=True)
class Expr:
    """Raw SQL standing in for a value: a pgbench variable or a per-row expression."""

    sql: str


def _plain(value: Any) -> Any:
    # StrEnum members bind as their value; give psycopg the plain string.
    return value.value if isinstance(value, Enum) else value


def escape_pgbench_colons(text: str) -> str:
    """Rewrite every string literal holding `:letter` so pgbench sees no variable in it."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "'":
            out.append(ch)
            i += 1
            continue
        # A literal runs to the next quote that is not doubled.
        j = i + 1
        while True:
            j = text.index("'", j)
            if j + 1 < len(text) and text[j + 1] == "'":
                j += 2
                continue
            break
        body = text[i + 1 : j]
        escaped = bool(out) and out[-1] in ("E", "e")
        if _PGBENCH_VARIABLE.search(body):
            if not escaped:
                body = body.replace("\\", "\\\\")
                out.append("E")
            body = body.replace(":", "\\x3a")
        out.append("'" + body + "'")
        i = j + 1
    return "".join(out)


def literal(conn: psycopg.Connection[Any], value: Any) -> str:
    """One value as a SQL literal, rendered by psycopg as it would bind it."""
    if isinstance(value, Expr):
        return value.sql
    return escape_pgbench_colons(sql.Literal(_plain(value)).as_string(conn))


def render(
    conn: psycopg.Connection[Any],
    statement: Statement,
    substitute: Mapping[str | int, Expr] | None = None,
) -> str:
    """A recorded statement as one line of SQL, with `substitute`d values replaced.

    A string value that contains a substituted string (a provider key holds
    the operation id) becomes a concatenation around the substitute.
    """
    substitute = dict(substitute or {})
    sentinels: dict[str, str] = {}
    params: dict[str, Any] = {}
    for name, raw in statement.params.items():
        value = _plain(raw)
        replacement = _replacement(conn, value, substitute)
        if replacement is None:
            params[name] = value
            continue
        sentinel = f"__pgbench_sentinel_{len(sentinels)}__"
        sentinels[f"'{sentinel}'"] = replacement
        params[name] = sentinel
    text = psycopg.ClientCursor(conn).mogrify(statement.sql, params)
    text = escape_pgbench_colons(text)
    for sentinel, replacement in sentinels.items():
        text = text.replace(sentinel, replacement)
    return " ".join(text.split())


def _replacement(
    conn: psycopg.Connection[Any], value: Any, substitute: Mapping[str | int, Expr]
) -> str | None:
    if isinstance(value, list):
        return _array_replacement(conn, value, substitute)
    if isinstance(value, Jsonb):
        return _jsonb_replacement(conn, value, substitute)
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    if value in substitute:
        return f"({substitute[value].sql})"
    if isinstance(value, str) and value.startswith("[{"):
        return _json_text_replacement(conn, value, substitute)
    if isinstance(value, str):
        for needle, expr in substitute.items():
            if isinstance(needle, str) and needle and needle in value:
                before, _, after = value.partition(needle)
                parts = [literal(conn, p) for p in (before,) if p]
                parts.append(f"CAST({expr.sql} AS text)")
                parts += [literal(conn, p) for p in (after,) if p]
                return "(" + " || ".join(parts) + ")"
    return None


def _array_replacement(
    conn: psycopg.Connection[Any], values: list[Any], substitute: Mapping[str | int, Expr]
) -> str | None:
    """An array parameter (the batch's ids, `store/batches.py`) as an ARRAY[...]
    constructor with every substituted element replaced (the statement casts it
    to its column's array type); None if no element is substituted."""
    elements = [_replacement(conn, value, substitute) for value in values]
    if all(element is None for element in elements):
        return None
    rendered = [
        element if element is not None else literal(conn, value)
        for element, value in zip(elements, values, strict=True)
    ]
    return "ARRAY[" + ", ".join(rendered) + "]"


def _jsonb_replacement(
    conn: psycopg.Connection[Any], value: Jsonb, substitute: Mapping[str | int, Expr]
) -> str | None:
    """A JSON value bound whole as `jsonb` (a column of our JSON type on
    PostgreSQL: the provider's answer an observation keeps) with every
    substituted value inside it replaced; None if nothing in it is.

    Written again by the standard library, not by the wrapper's own dumps:
    `jsonb` keeps the value, not the text, so the spacing and escapes of the
    text sent do not reach the server's row. A plain `json` value keeps its
    text and is left as psycopg binds it (the leftover check refuses a script
    in which it still names the recorded run)."""
    try:
        text = json.dumps(value.obj)
    except (TypeError, ValueError):
        return None
    spliced = _json_text_replacement(conn, text, substitute)
    return None if spliced is None else f"CAST({spliced} AS jsonb)"


_JSON_SENTINEL = re.compile(r'"__pgbench_value_(\d+)__"|__pgbench_part_(\d+)__')


def _json_text_replacement(
    conn: psycopg.Connection[Any], value: str, substitute: Mapping[str | int, Expr]
) -> str | None:
    """JSON text (a parameter of rows as `jsonb_to_recordset` reads them, or a
    `jsonb` value bound whole) with every substituted value inside it
    replaced: a value equal to one becomes the substitute as JSON, a string
    containing one has it spliced in. None if nothing in it is substituted."""
    try:
        rows = json.loads(value)
    except ValueError:
        return None
    exprs: list[str] = []

    def swap(node: Any) -> Any:
        if isinstance(node, list):
            return [swap(item) for item in node]
        if isinstance(node, dict):
            return {key: swap(item) for key, item in node.items()}
        if isinstance(node, bool) or not isinstance(node, str | int):
            return node
        if node in substitute:
            exprs.append(
                f"to_jsonb(CAST({substitute[node].sql} AS text))::text"
                if isinstance(node, str)
                else f"CAST(CAST({substitute[node].sql} AS bigint) AS text)"
            )
            return f"__pgbench_value_{len(exprs) - 1}__"
        if isinstance(node, str):
            for needle, expr in substitute.items():
                if isinstance(needle, str) and needle and needle in node:
                    # Ids and keys need no JSON escaping: spliced in as they are.
                    exprs.append(f"CAST({expr.sql} AS text)")
                    return node.replace(needle, f"__pgbench_part_{len(exprs) - 1}__")
        return node

    text = json.dumps(swap(rows), ensure_ascii=False)
    if not exprs:
        return None
    parts: list[str] = []
    at = 0
    for match in _JSON_SENTINEL.finditer(text):
        parts.append(literal(conn, text[at : match.start()]))
        parts.append(exprs[int(match.group(1) or match.group(2))])
        at = match.end()
    parts.append(literal(conn, text[at:]))
    return "(" + " || ".join(parts) + ")"


START_PIPELINE = "\\startpipeline"
END_PIPELINE = "\\endpipeline"


def transaction_block(lines: Sequence[str], gset_first: bool = False) -> list[str]:
    """BEGIN; the statements; COMMIT; the first may end in `\\gset` instead of `;`.
    Meta-commands (`\\startpipeline`...) pass through as they are."""
    block = ["BEGIN;"]
    for n, line in enumerate(lines):
        if line.startswith("\\"):
            block.append(line)
        else:
            block.append(line + (" \\gset" if gset_first and n == 0 else ";"))
    block.append("COMMIT;")
    return block


def pipelined(statements: Sequence[tuple[str, bool]]) -> list[str]:
    """Lines with each run of executemany statements inside a pgbench pipeline,
    as psycopg sends them: `(line, pipelined)` in, lines and meta-commands out."""
    out: list[str] = []
    inside = False
    for line, in_pipeline in statements:
        if in_pipeline != inside:
            out.append(START_PIPELINE if in_pipeline else END_PIPELINE)
            inside = in_pipeline
        out.append(line)
    if inside:
        out.append(END_PIPELINE)
    return out


def insert_select(
    conn: psycopg.Connection[Any], table: str, values: Mapping[str, Any], rows: int
) -> str:
    """`INSERT INTO table (...) SELECT ... FROM generate_series(1, rows) AS g`.

    Per-row values are `Expr`s over `g`; everything else is a literal.
    """
    columns = ", ".join(values)
    selected = ", ".join(literal(conn, v) for v in values.values())
    return (
        f"INSERT INTO {table} ({columns}) SELECT {selected} "
        f"FROM generate_series(1, {int(rows)}) AS g"
    )
