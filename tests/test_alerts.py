"""docs/alerts.yml is valid Prometheus rules, and its alerts fire when they
should and not before (tests/alerts_test.yml). promtool is Debian's
`prometheus` package (scripts/ensure-test-tools installs it): missing, this
fails rather than skips."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def promtool() -> str:
    found = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    assert found is not None, "promtool is missing: run scripts/ensure-test-tools"
    return found


def test_alert_rules_pass_promtool_check() -> None:
    done = subprocess.run(
        [promtool(), "check", "rules", str(ROOT / "docs" / "alerts.yml")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_alerts_fire_when_they_should() -> None:
    done = subprocess.run(
        [promtool(), "test", "rules", "alerts_test.yml"],
        capture_output=True,
        text=True,
        cwd=ROOT / "tests",
    )
    assert done.returncode == 0, done.stdout + done.stderr
