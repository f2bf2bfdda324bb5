"""The bench's rendering of recorded statements into pgbench lines
(bench/sqlscript.py): an array parameter, as the batch's locks bind their ids
on PostgreSQL, keeps the pgbench variables that stand for the claimed rows, and
so does a `jsonb` value bound whole; a script that would still name the recorded
run's own rows is refused (bench/workloads.py)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg.types.json import Json, Jsonb

from intentledger.store.database import libpq_url
from intentledger_tools.bench.capture import DispatchCapture, IntakeCapture, Statement
from intentledger_tools.bench.sqlscript import Expr, render
from intentledger_tools.bench.workloads import dispatch_script, intake_script, without_leftovers
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


RECORDED_OPERATION = "op_0123456789abcdef01234567"
RECORDED_ROW = 770_000_007
CLAIM = Statement("UPDATE outbox SET lease_owner = %(owner)s RETURNING id", {"owner": "w"})


def _dispatch(value: object) -> DispatchCapture:
    return DispatchCapture(
        transactions=[[CLAIM], [Statement("SELECT %(value)s", {"value": value})]],
        claimed=[(RECORDED_ROW, RECORDED_OPERATION)],
    )


def _select_line(script: str) -> str:
    return next(line for line in script.splitlines() if line.startswith("SELECT"))


def test_a_jsonb_value_bound_whole_names_each_run_s_own_operation(
    databases: Databases,
) -> None:
    url = databases.create("postgresql")
    with psycopg.connect(libpq_url(url)) as conn:
        # A provider's answer, as an observation's detail binds it.
        answer = Jsonb({"body": {"id": "ch_1", "reference": RECORDED_OPERATION, "n": 2}})
        line = _select_line(dispatch_script(conn, _dispatch(answer)))
        assert RECORDED_OPERATION not in line and "AS jsonb)" in line
        ran = conn.execute(line.replace(":op_1", "'op_this_run'")).fetchone()
        assert ran == ({"body": {"id": "ch_1", "reference": "op_this_run", "n": 2}},)

        # Naming no recorded row, it is bound as psycopg binds it.
        other = Statement("SELECT %(value)s", {"value": Jsonb({"reference": "op_other"})})
        assert render(conn, other, {RECORDED_OPERATION: Expr(":op_1")}) == render(conn, other)


def test_a_key_and_rows_name_each_run_s_own_operation_and_row(databases: Databases) -> None:
    url = databases.create("postgresql")
    with psycopg.connect(libpq_url(url)) as conn:
        key = dispatch_script(conn, _dispatch(f"pay_{RECORDED_OPERATION}_1"))
        rows = dispatch_script(conn, _dispatch(f'[{{"id": {RECORDED_ROW}}}]'))
        assert ":op_1" in key and ":id_1" in rows
        assert RECORDED_OPERATION not in key and str(RECORDED_ROW) not in rows


def test_the_scripts_refuse_what_their_rendering_does_not_reach(databases: Databases) -> None:
    url = databases.create("postgresql")
    with psycopg.connect(libpq_url(url)) as conn:
        # A plain `json` value keeps its text, and the rendering leaves it be;
        # an object's key is never substituted.
        for unreached in (Json({"reference": RECORDED_OPERATION}), Jsonb({RECORDED_OPERATION: 1})):
            with pytest.raises(RuntimeError, match=RECORDED_OPERATION):
                dispatch_script(conn, _dispatch(unreached))
        intake = IntakeCapture(
            transaction=[Statement("SELECT %(v)s", {"v": Json({"key": "bench-key-1"})})],
            operation_id=RECORDED_OPERATION,
            idempotency_key="bench-key-1",
            rows=[],
        )
        with pytest.raises(RuntimeError, match="bench-key-1"):
            intake_script(conn, intake, "pi")


def test_a_recorded_id_is_found_anywhere_and_a_row_only_as_a_whole_number() -> None:
    for script in (f"SELECT '{RECORDED_OPERATION}'", f"SELECT 'pay_{RECORDED_OPERATION}_1'"):
        with pytest.raises(RuntimeError, match=RECORDED_OPERATION):
            without_leftovers(script, [RECORDED_OPERATION], "dispatch")
    row = str(RECORDED_ROW)
    with pytest.raises(RuntimeError, match=row):
        without_leftovers(f"UPDATE outbox SET x = 1 WHERE id = {row}", [row], "dispatch")
    # Inside a longer number it is not the row.
    longer = f"SELECT {row}1, 1{row}"
    assert without_leftovers(longer, [row], "dispatch") == longer
