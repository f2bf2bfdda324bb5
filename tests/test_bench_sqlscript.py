"""The bench's rendering of recorded statements into pgbench lines
(bench/sqlscript.py): an array parameter, as the batch's locks bind their ids
on PostgreSQL, keeps the pgbench variables that stand for the claimed rows."""

from __future__ import annotations

import psycopg

from intentledger.store.database import libpq_url
from intentledger_tools.bench.capture import Statement
from intentledger_tools.bench.sqlscript import Expr, render
from tests.conftest import Databases

UNNEST = "SELECT x FROM unnest(%(ids)s::VARCHAR(40)[]) WITH ORDINALITY AS u(x, n) ORDER BY n"


def test_an_array_parameter_keeps_its_substituted_elements(databases: Databases) -> None:
    url = databases.create("postgresql")
    with psycopg.connect(libpq_url(url)) as conn:
        substitute = {"op_a": Expr(":op_1"), "op_c": Expr(":op_3"), 7: Expr(":id_2")}
        line = render(conn, Statement(UNNEST, {"ids": ["op_a", "op_b", "op_c"]}), substitute)
        assert "ARRAY[(:op_1), 'op_b', (:op_3)]::VARCHAR(40)[]" in line
        # pgbench puts each variable's value, quoted, where it is named.
        ran = conn.execute(line.replace(":op_1", "'op_x'").replace(":op_3", "'op_z'"))
        assert [row[0] for row in ran] == ["op_x", "op_b", "op_z"]

        numbers = render(
            conn,
            Statement("SELECT array_length(%(ids)s::INTEGER[], 1)", {"ids": [7, 8]}),
            substitute,
        )
        assert "ARRAY[(:id_2), 8]::INTEGER[]" in numbers
        assert conn.execute(numbers.replace(":id_2", "'5'")).fetchone() == (2,)

        # No element stands for a claimed row: the array as psycopg binds it.
        plain = render(conn, Statement(UNNEST, {"ids": ["op_q", "op_r"]}), substitute)
        assert "ARRAY" not in plain
        assert [row[0] for row in conn.execute(plain)] == ["op_q", "op_r"]
