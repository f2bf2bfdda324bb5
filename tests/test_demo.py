"""`intentledger demo` runs every scenario to rest (it uses its own SQLite ledger)."""

from __future__ import annotations

import os
import subprocess

from intentledger_tools.demo import SCENARIOS
from tests.support import INTENTLEDGER


def test_demo_brings_every_scenario_to_rest() -> None:
    done = subprocess.run(
        [*INTENTLEDGER, "demo", "--timeout", "90"],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "COLUMNS": "220"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    final = done.stdout[done.stdout.rindex("intentledger demo") :]
    rows = {line.split("│")[1].strip(): line for line in final.splitlines() if line.count("│") > 5}
    for scenario in SCENARIOS:
        assert scenario in rows, (scenario, final)
        # Each pays 1000 EUR cents, shown as every display shows an amount.
        assert "10.00 EUR (1000)" in rows[scenario], rows[scenario]
    assert "MANUAL_REVIEW → operator" in rows["pm_blackhole"]
    assert rows["pm_declined"].rstrip(" │").endswith("0")
    assert "KNOWN (succeeded)" in rows["pm_timeout_before_execute"]
