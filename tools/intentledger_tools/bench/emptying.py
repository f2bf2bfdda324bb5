"""Emptying the ledger between phases, so that each phase starts as a new ledger does.

TRUNCATE alone leaves a trap. The rows a phase inserted still count as changes
since the table's last ANALYZE after they are truncated, so autovacuum analyzes
the table at its next look (once a minute), now empty. If that look falls
between the truncate and the phase's load, the table's statistics say it holds
nothing, and every connection that plans a query on it afterwards may pick a
sequential scan. The foreign-key checks PostgreSQL runs for each outbox row and
transition are such queries, kept as generic plans for the connection's life:
each one then reads the whole `operations` table, and intake falls to a crawl
until the next ANALYZE replaces the plans. Seen in the pooler phase: direct
intake at 757, 765 and 782/s instead of about 5,900, with `operations` scanned
sequentially twice per intent and never by index (docs/benchmarks.md).

A table a migration has just created has never been analyzed, and the planner
then assumes a few pages rather than none: its plans use the indexes. TRUNCATE
leaves the planner's figures in that state (no pages, row count unknown);
resetting the emptied tables' counters as well keeps autovacuum from analyzing
them before the phase's own rows are there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql


def empty_tables(conn: psycopg.Connection[Any], tables: Sequence[str]) -> bool:
    """TRUNCATE `tables` (and their partitions) and reset their statistics
    counters. False when the server refused the reset (it needs a superuser or
    EXECUTE on `pg_stat_reset_single_table_counters` and
    `pg_stat_force_next_flush`) or cannot do it (`pg_stat_force_next_flush` is
    PostgreSQL 15's): the tables are emptied all the same, and autovacuum may
    then analyze them while they are empty."""
    names = sql.SQL(", ").join(sql.Identifier(t) for t in tables)
    conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(names))
    try:
        # This session's own counts of the truncate must reach the shared
        # statistics first, or they would land after the reset.
        conn.execute("SELECT pg_stat_force_next_flush()")
        # The tables themselves, and the partitions of those that have some
        # (pg_partition_tree lists nothing for a table without partitions).
        conn.execute(
            "SELECT pg_stat_reset_single_table_counters(c.oid) FROM pg_class AS c"
            " WHERE c.oid = ANY(%(tables)s::regclass[]) OR c.oid IN ("
            "SELECT tree.relid FROM unnest(%(tables)s::regclass[]) AS t(root),"
            " pg_partition_tree(t.root) AS tree)",
            {"tables": list(tables)},
        )
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.UndefinedFunction):
        return False
    return True
