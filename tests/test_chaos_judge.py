"""The chaos judge reads the provider's truth only after every writer stopped.

A run that ends out of time still has API and worker processes at work: a
payment executed and recorded between reading the provider's truth and reading
the ledger would count as a contradiction that is not one. `judge` stops them
first; here real processes stand in for the fleet's writers, and the truth is
read by a stand-in that fails if one of them is still alive.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import insert

from intentledger.store import tables
from intentledger.store.database import create_sync_engine
from intentledger_tools import chaos
from intentledger_tools.chaos import ChaosConfig, Fleet, Tally, Truth
from tests.test_cli import run
from tests.test_partitions import AT


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_the_truth_is_read_only_after_every_writer_stopped(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = ChaosConfig(database_url)
    fleet = Fleet(config, tmp_path)
    fleet.procs = {"api0": _sleeper(), "worker0": _sleeper(), "sandbox": _sleeper()}

    def truth(_url: str) -> Truth:
        for name, proc in fleet.procs.items():
            if name == "sandbox":
                assert proc.poll() is None, "the sandbox must stay up to be read"
            else:
                assert proc.poll() is not None, f"the truth was read while {name} could write"
        return Truth(Counter())

    monkeypatch.setattr(chaos, "sandbox_truth", truth)
    try:
        report = chaos.judge(config, fleet, Tally())
    finally:
        fleet.stop_all()
    assert report["contradictions"] == 0
    assert report["sandbox_key_retention"] == "30s"


def _operation(operation_id: str, **values: object) -> dict[str, object]:
    return {
        "operation_id": operation_id,
        "idempotency_key": f"k-{operation_id}",
        "request_context": {"body": {}},
        "next_action": "none",
        "actor": "dora",
        "route": "POST /v1/payments",
        "request_hash": "0" * 64,
        "provider": "sandbox",
        "amount": 500,
        "currency": "EUR",
        "version": 1,
        "created_at": AT,
        "updated_at": AT,
        **values,
    }


def test_the_ledger_s_refund_books_are_judged_against_each_charge(database_url: str) -> None:
    """Refunds the ledger counts refunded or held beyond what the charge took,
    and refunds the provider made that the ledger does not hold, are
    violations, whatever the provider itself refused."""
    engine = create_sync_engine(database_url)
    with engine.begin() as conn:
        for number, charge in ((1, "ch_1"), (2, "ch_2")):
            conn.execute(
                insert(tables.operations).values(
                    **_operation(
                        f"op_pay{number}",
                        kind="payment",
                        state="OUTCOME_KNOWN",
                        outcome="succeeded",
                        provider_reference=charge,
                    )
                )
            )
        for number, amount in ((1, 300), (2, 300)):  # 600 of ch_1's 500, both unknown
            conn.execute(
                insert(tables.operations).values(
                    **_operation(
                        f"op_refund{number}",
                        kind="refund",
                        state="UNKNOWN",
                        amount=amount,
                        parent_operation_id="op_pay1",
                        request_context={"body": {}, "charge": "ch_1"},
                    )
                )
            )
    engine.dispose()
    truth = Truth(Counter(), {"ch_1": 500, "ch_2": 500}, Counter({"ch_1": 300, "ch_2": 100}))
    report = chaos.check(database_url, truth, Tally())
    assert report["ledger_over_refunded"] == 1  # ch_1: 600 held against 500
    assert report["refunds_unaccounted"] == 1  # ch_2: 100 refunded, nothing held
    assert report["over_refunded"] == 0  # the provider itself moved no more than it took


@pytest.mark.parametrize(
    ("value", "says"), [("0s", "must be more than 0"), ("a day", "--sandbox-key-retention")]
)
def test_a_bad_sandbox_key_retention_is_refused_before_anything_starts(
    value: str, says: str
) -> None:
    done = run(
        "chaos",
        "--database-url",
        "postgresql://nobody@127.0.0.1:1/none",
        "--sandbox-key-retention",
        value,
    )
    assert done.returncode == 2, done
    assert says in done.stderr


def test_a_run_with_a_retention_starts_every_process_through_the_tools_build(
    tmp_path: Path,
) -> None:
    """The service refuses a window of minutes: `--retention` starts the fleet
    through intentledger_tools.short_retention, a mutation's worker included."""
    python = [sys.executable, "-m"]
    plain = Fleet(ChaosConfig("postgresql://unused/none"), tmp_path)
    assert plain._command("api0")[:3] == [*python, "intentledger.cli"]
    assert "INTENTLEDGER_REPLAY_WINDOW" not in plain.env
    config = ChaosConfig(
        "postgresql://unused/none", retention=timedelta(minutes=3), mutation="blind-retry"
    )
    fleet = Fleet(config, tmp_path)
    assert fleet.env["INTENTLEDGER_REPLAY_WINDOW"] == "3m"
    through = [*python, chaos.SHORT_RETENTION, "--run"]
    assert fleet._command("sandbox")[:6] == [*through, "intentledger.cli", "sandbox"]
    assert fleet._command("api0")[:6] == [*through, "intentledger.cli", "serve"]
    assert fleet._command("worker0")[:6] == [*through, chaos.MUTATIONS["blind-retry"], "worker"]


def test_the_adyen_fake_s_truth_counts_what_it_executed() -> None:
    """A payment executed if it was authorised, at once or by the notification
    that settled its Pending answer; a refund if its REFUND said success.
    Refused, still-Pending and failed refunds executed nothing."""

    def payment(psp: str, reference: str, code: str, settled: bool | None) -> dict[str, object]:
        return {
            "pspReference": psp,
            "reference": reference,
            "resultCode": code,
            "settled": settled,
            "amount": {"value": 500, "currency": "EUR"},
        }

    def refund(psp: str, reference: str, settled: str) -> dict[str, object]:
        amount = {"value": 200, "currency": "EUR"}
        return {
            "paymentPspReference": psp,
            "reference": reference,
            "settled": settled,
            "amount": amount,
        }

    truth = chaos.adyen_truth(
        {
            "payments": [
                payment("p1", "op_1", "Authorised", True),
                payment("p2", "op_2", "Pending", True),
                payment("p3", "op_3", "Pending", None),
                payment("p4", "op_4", "Refused", False),
                payment("p5", "op_5", "Pending", False),
                payment("p6", "op_1", "Authorised", True),  # a second execution of op_1
            ],
            "refunds": [
                refund("p1", "op_r1", "REFUND"),
                refund("p1", "op_r2", "REFUND_FAILED"),
                refund("p1", "op_r3", "REFUND:false"),
                refund("p2", "op_r4", "REFUND"),
                refund("p2", "op_r5", "REFUND"),
            ],
        }
    )
    assert truth.executed == Counter({"op_1": 2, "op_2": 1, "op_r1": 1, "op_r4": 1, "op_r5": 1})
    assert truth.captured == {"p1": 500, "p2": 500, "p6": 500}
    assert truth.refunded == Counter({"p1": 200, "p2": 400})
