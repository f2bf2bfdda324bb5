"""The bench's SQL workloads, all rendered from the recorded code paths.

- the intake transaction as a pgbench script (a fresh operation id and key per run);
- the claim, pre-submit and record transactions of one batch delivery as a
  pgbench script (the claim's rows feed the next two through `\\gset`);
- bulk loads of ledger rows shaped exactly like the intake's, by
  `INSERT ... SELECT ... FROM generate_series`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from intentledger_tools.bench.capture import DispatchCapture, IntakeCapture, payment_body
from intentledger_tools.bench.sqlscript import (
    Expr,
    insert_select,
    pipelined,
    render,
    transaction_block,
)

# Operation ids are "op_" and 24 hex digits; bench ids keep that length.
_ID_DIGITS = 24


def operation_id_expr(tag: str, counter: str) -> str:
    return f"'op_' || lpad('{tag}' || {counter}, {_ID_DIGITS}, '0')"


def key_expr(tag: str, counter: str) -> str:
    return f"'k{tag}-' || {counter}"


# Per pgbench client: its id and a counter kept across its transactions (-D n=0).
_PGBENCH_COUNTER = "CAST(:client_id AS text) || 'n' || CAST(:n AS text)"
_ROW_COUNTER = "g::text"


def intake_script(conn: psycopg.Connection[Any], capture: IntakeCapture, tag: str) -> str:
    """`accept()`'s transaction, statement for statement."""
    substitute: dict[str | int, Expr] = {
        capture.operation_id: Expr(operation_id_expr(tag, _PGBENCH_COUNTER)),
        capture.idempotency_key: Expr(key_expr(tag, _PGBENCH_COUNTER)),
    }
    lines = [render(conn, s, substitute) for s in capture.transaction]
    script = "\n".join(["\\set n :n + 1", *transaction_block(lines)]) + "\n"
    return without_leftovers(script, (capture.operation_id, capture.idempotency_key), "intake")


def dispatch_script(conn: psycopg.Connection[Any], capture: DispatchCapture) -> str:
    """One batch delivery: claim, pre-submit, record, for `capture.batch` payments.

    pgbench's `\\gset` takes one row, so the recorded claim runs inside a CTE
    that hands its rows on as variables `id_k` and `op_k` (k = 1..batch, in row
    id order); every later statement names the claimed rows through them.
    """
    substitute: dict[str | int, Expr] = {}
    columns = []
    for k, (outbox_id, operation_id) in enumerate(capture.claimed, start=1):
        substitute[outbox_id] = Expr(f":id_{k}")
        substitute[operation_id] = Expr(f":op_{k}")
        columns.append(f"c.ids[{k}] AS id_{k}, c.ops[{k}] AS op_{k}")
    claim, *rest = capture.transactions
    if len(claim) != 1:
        raise RuntimeError(f"expected the claim to be one statement, saw {len(claim)}")
    claimed = (
        f"WITH claimed AS ({render(conn, claim[0])}) SELECT {', '.join(columns)} "
        "FROM (SELECT array_agg(id ORDER BY id) AS ids, "
        "array_agg(operation_id ORDER BY id) AS ops FROM claimed) AS c"
    )
    out = transaction_block([claimed], gset_first=True)
    for transaction in rest:
        lines = pipelined([(render(conn, s, substitute), s.pipelined) for s in transaction])
        out += transaction_block(lines)
    script = "\n".join(out) + "\n"
    recorded = [str(value) for pair in capture.claimed for value in pair]
    return without_leftovers(script, recorded, "dispatch")


def without_leftovers(script: str, recorded: Iterable[str], script_name: str) -> str:
    """`script`, once no id or key of the recorded run is left in it.

    A value the rendering does not reach (a parameter of a shape it does not
    substitute in) would keep the recorded row's id, and every pgbench
    transaction would write or look for that one row: a baseline that is not
    the work it stands for. An operation id or key is looked for
    anywhere (a provider key holds the operation id); it cannot occur by
    chance. A recorded outbox row id is looked for as a whole number: the
    bench draws them from 770,000,001 on so that none can occur by chance
    either (bench/runner.py, `CAPTURE_OUTBOX_ID_FROM`)."""
    for value in recorded:
        pattern = re.escape(value)
        if value.isdigit():
            pattern = rf"(?<!\d){pattern}(?!\d)"
        found = re.search(pattern, script)
        if found:
            at = found.start()
            around = script[max(at - 200, 0) : at + len(value) + 100]
            raise RuntimeError(
                f"the {script_name} script still names the recorded run's {value!r}, "
                f"which every run of it would reuse: …{around}…"
            )
    return script


def with_payment_method(context: Any, payment_method: str) -> Jsonb:
    obj = context.obj if isinstance(context, Jsonb) else context
    return Jsonb({**obj, "body": {**obj["body"], **payment_body(payment_method)}})


def seed(
    conn: psycopg.Connection[Any],
    capture: IntakeCapture,
    rows: int,
    tag: str,
    *,
    payment_method: str = "pm_ok",
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    tables: frozenset[str] | None = None,
) -> list[str]:
    """Insert `rows` intakes' worth of rows, shaped as the recorded intake wrote them;
    returns the tables written, in the intake's order.

    `overrides` changes or adds columns per table (an `Expr` may use `g`, the
    row number); `tables` limits the load to some of the intake's tables.
    """
    written: list[str] = []
    per_row = {
        capture.operation_id: Expr(operation_id_expr(tag, _ROW_COUNTER)),
        capture.idempotency_key: Expr(key_expr(tag, _ROW_COUNTER)),
    }
    for table, recorded in capture.insert_values():
        if tables is not None and table not in tables:
            continue
        values: dict[str, Any] = {}
        for column, value in recorded.items():
            if isinstance(value, str) and value in per_row:
                values[column] = per_row[value]
            elif column == "request_context":
                values[column] = with_payment_method(value, payment_method)
            else:
                values[column] = value
        values.update((overrides or {}).get(table, {}))
        conn.execute(insert_select(conn, table, values, rows).encode())
        if table not in written:
            written.append(table)
    return written


def analyze(conn: psycopg.Connection[Any], tables: Sequence[str]) -> None:
    """ANALYZE `tables` on `conn`, inside its open transaction if it has one.

    A seed loads tables the bench has just emptied, whose statistics are those
    of a new table (bench/emptying.py). Until autovacuum's first look, up to a
    minute later, the planner then reads the seeded `operations` and `outbox`
    by sequential scan in the claim's neighbours (the pre-submit's lease check,
    the attempts' insert, the group record), and the server spent about three
    times its CPU per payment in a drain's first minute (docs/benchmarks.md,
    step 50). ANALYZE run in the seed's own transaction samples the rows that
    transaction inserted, so the statistics are there at the seed's commit,
    before any worker plans a statement on them.

    Never a bare ANALYZE: with no table named it would analyze the whole
    database, the emptied ledger tables among them (the trap bench/emptying.py
    describes)."""
    if not tables:
        raise ValueError("analyze: name the tables a seed wrote")
    conn.execute(sql.SQL("ANALYZE {}").format(sql.SQL(", ").join(map(sql.Identifier, tables))))
