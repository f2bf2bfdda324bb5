"""The pure work of a batched first attempt (bench/domain_cost.py, issue 39): it
runs the real domain and engine calls, and fails rather than time a path the
payments did not take."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.domain.evidence import Limits
from intentledger.engine import batch_dispatch, changes, dispatcher, settlement_queue
from intentledger.store.ledger import OperationWrite
from intentledger.store.records import OperationRecord
from intentledger_tools.bench import domain_cost
from intentledger_tools.bench.domain_cost import (
    NOW,
    RESULT_PREFIX,
    measure,
    operation_row,
    pre_submit,
    record,
)
from tests.test_group_news import pay, settle_as_a_group
from tests.test_recovery_model import Scene

MODULE = "intentledger_tools.bench.domain_cost"


def test_a_row_holds_every_column_of_an_operation_in_order() -> None:
    row = operation_row(7, state="SUBMITTING", version=2)
    operation = OperationRecord.of(row)  # type: ignore[arg-type]
    assert operation.operation_id == f"op_{7:024x}"
    assert (operation.state, operation.version) == ("SUBMITTING", 2)
    with pytest.raises(KeyError, match="no column"):
        operation_row(1, status="ACCEPTED")


def test_every_payment_is_prepared_and_settled_plainly() -> None:
    figures = measure(50, 24, 20)
    assert (figures["payments"], figures["claim"], figures["group"]) == (50, 24, 20)
    assert figures["cpu_s"] > 0 and figures["us_per_payment"] > 0


def test_a_run_whose_payments_do_not_all_settle_plainly_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The funnel no longer settling a plain success plainly: the run must not time
    # a path the payments did not take.
    real = domain_cost._plain_settlement
    seen: list[int] = []

    def every_other(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs) if len(seen) % 2 else None

    monkeypatch.setattr(domain_cost, "_plain_settlement", every_other)
    with pytest.raises(RuntimeError, match="only 5 of 10 payments settled plainly"):
        measure(10, 4, 3)


def test_a_path_the_payments_do_not_take_fails_the_run() -> None:
    accepted = [operation_row(n) for n in range(3)]
    prepared = pre_submit(accepted)
    limits = Limits(timedelta(hours=1))
    # The operation as the pre-submit handed it on settles; one in another state does not.
    assert record(prepared, limits) == 3
    moved = [
        replace(item, operation=item.operation.updated({"state": "UNKNOWN"})) for item in prepared
    ]
    assert record(moved, limits) == 0
    # A payment already attempted is no plain first attempt.
    with pytest.raises(RuntimeError, match="not a plain first attempt"):
        pre_submit([operation_row(0, first_attempt_at=NOW)])


def test_the_command_prints_one_result_line_and_refuses_bad_sizes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", MODULE, "--payments", "200", "--claim", "25", "--group", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(line.removeprefix(RESULT_PREFIX))
    assert (result["payments"], result["claim"], result["group"]) == (200, 25, 16)
    refused = subprocess.run(
        [sys.executable, "-m", MODULE, "--claim", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "at least 1" in refused.stderr


async def test_the_pure_work_makes_the_changes_the_batched_path_makes(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real claim, pre-submit and group record, on a ledger, against the pure
    work fed the records they read: the same changes, attempts and observation
    rows, but for the instants, the worker's name, the provider's reference and
    words. A step the batched path gains that changes what it writes shows here."""
    made: list[list[changes.OperationChange]] = []
    real_alike = changes.alike

    def kept(planned: Sequence[changes.OperationChange]) -> list[OperationWrite]:
        made.append(list(planned))
        return real_alike(planned)

    monkeypatch.setattr(changes, "alike", kept)
    # The attempt rows the pre-submit writes and the observation rows the group
    # record writes, whoever makes them.
    rows: dict[str, list[Any]] = {"attempt": [], "observation": []}

    def keeping(kind: str, make: Any) -> Any:
        def made_and_kept(*args: Any, **kwargs: Any) -> Any:
            out = make(*args, **kwargs)
            rows[kind].append(out[0] if kind == "attempt" else out)
            return out

        return made_and_kept

    for module in (batch_dispatch, domain_cost):
        monkeypatch.setattr(module, "begin_attempt", keeping("attempt", dispatcher.begin_attempt))
    observed = keeping("observation", dispatcher.submit_result)
    for module in (settlement_queue, domain_cost):
        monkeypatch.setattr(module, "submit_result", observed)
    scene = Scene(engine)
    for n in range(3):
        await pay(scene, "alice", f"domain-cost-{n}")
    await settle_as_a_group(scene, 3)
    (presubmitted, settled), made[:] = made, []
    real_rows = {kind: list(kept_rows) for kind, kept_rows in rows.items()}
    for kept_rows in rows.values():
        kept_rows.clear()
    accepted = [tuple(change.before.as_dict().values()) for change in presubmitted]
    assert record(pre_submit(accepted), Limits(timedelta(hours=1))) == 3
    pure_presubmitted, pure_settled = made
    workers = {scene.worker.worker_id, domain_cost.WORKER}

    def plain(value: Any) -> Any:
        if isinstance(value, datetime):
            return "an instant"
        if isinstance(value, str) and value.startswith("ch_"):
            return "a reference"
        if isinstance(value, str) and value in workers:
            return "the worker"
        if isinstance(value, list | tuple):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    def shape(change: changes.OperationChange) -> Any:
        transition = plain(dict(change.rows.transition or {}))
        # The reason is the adapter's reading of the answer, in its own words:
        # the sandbox's ("provider answered 200") and the test's answer's differ.
        if transition.get("reason"):
            transition["reason"] = "the adapter's reason"
        return (change.target, plain(dict(change.values)), transition, change.rows.shift)

    def readable(row: Any) -> Any:
        # An observation's reason and detail are the adapter's reading and the
        # provider's body, in their own words (the test's answer is not the
        # sandbox's); that there is some of each is what must agree.
        read = plain(dict(row))
        for words in ("reason", "detail"):
            if read.get(words):
                read[words] = "the provider's words"
        return read

    assert [shape(c) for c in pure_presubmitted] == [shape(c) for c in presubmitted]
    assert [shape(c) for c in pure_settled] == [shape(c) for c in settled]
    for kind in ("attempt", "observation"):
        assert len(rows[kind]) == len(real_rows[kind]) == 3, kind
        assert [readable(row) for row in rows[kind]] == [
            readable(row) for row in real_rows[kind]
        ], kind
