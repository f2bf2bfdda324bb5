"""Intake's own Python (bench/intake_cost.py, issue 39): it times the real intake
route, and fails rather than time a path the intents did not take."""

from __future__ import annotations

import json
import subprocess
import sys

import orjson
import pytest

from intentledger_tools.bench import intake_cost
from intentledger_tools.bench.intake_cost import RESULT_PREFIX, measure

MODULE = "intentledger_tools.bench.intake_cost"


def test_the_command_times_the_route_against_its_driver() -> None:
    done = subprocess.run(
        [sys.executable, "-m", MODULE, "--intents", "300", "--concurrency", "8"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    result = json.loads(line.removeprefix(RESULT_PREFIX))
    assert (result["intents"], result["concurrency"]) == (300, 8)
    assert result["route_us_per_intent"] > result["driver_us_per_intent"] > 0
    assert result["own_us_per_intent"] == pytest.approx(
        result["route_us_per_intent"] - result["driver_us_per_intent"], abs=0.02
    )


def test_a_run_whose_intents_are_not_accepted_fails() -> None:
    refused = orjson.dumps({"amount": "1250", "currency": "EUR", "payment_method": "pm_ok"})
    with pytest.raises(RuntimeError, match="did not accept every intent"):
        measure(50, 8, refused)


@pytest.mark.parametrize(
    "options", [["--intents", "0"], ["--concurrency", "0"], ["--intents", "x"]]
)
def test_bad_options_are_refused(options: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        intake_cost.main(options)
    assert exited.value.code == 2
    assert "error" in capsys.readouterr().err
