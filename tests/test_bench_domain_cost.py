"""The pure work of a batched first attempt (bench/domain_cost.py, issue 39): it
runs the real domain and engine calls, and fails rather than time a path the
payments did not take."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import pytest

from intentledger.domain.evidence import Limits
from intentledger.store.records import OperationRecord
from intentledger_tools.bench.domain_cost import (
    NOW,
    RESULT_PREFIX,
    measure,
    operation_row,
    pre_submit,
    record,
)

MODULE = "intentledger_tools.bench.domain_cost"


def test_a_row_holds_every_column_of_an_operation_in_order() -> None:
    row = operation_row(7, state="SUBMITTING", version=2)
    operation = OperationRecord.of(row)  # type: ignore[arg-type]
    assert operation.operation_id == f"op_{7:024x}"
    assert (operation.state, operation.version) == ("SUBMITTING", 2)
    with pytest.raises(KeyError, match="no column"):
        operation_row(1, status="ACCEPTED")


def test_every_payment_is_prepared_and_settled_plainly() -> None:
    figures = measure(50, 20)
    assert figures["payments"] == 50 and figures["group"] == 20
    assert figures["cpu_s"] > 0 and figures["us_per_payment"] > 0


def test_a_path_the_payments_do_not_take_fails_the_run() -> None:
    accepted = [operation_row(n) for n in range(3)]
    prepared = pre_submit(accepted)
    limits = Limits(timedelta(hours=1))
    # The operation as the pre-submit left it settles; one touched since does not.
    left = [operation_row(n, state="SUBMITTING", version=2, first_attempt_at=NOW) for n in range(3)]
    assert record(left, prepared, limits) == 3
    moved = [
        operation_row(n, state="SUBMITTING", version=3, first_attempt_at=NOW) for n in range(3)
    ]
    assert record(moved, prepared, limits) == 0
    # A payment already attempted is no plain first attempt.
    with pytest.raises(RuntimeError, match="not a plain first attempt"):
        pre_submit([operation_row(0, first_attempt_at=NOW)])


def test_the_command_prints_one_result_line_and_refuses_bad_sizes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", MODULE, "--payments", "200", "--group", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(line.removeprefix(RESULT_PREFIX))
    assert (result["payments"], result["group"]) == (200, 16)
    refused = subprocess.run(
        [sys.executable, "-m", MODULE, "--payments", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "at least 1" in refused.stderr
