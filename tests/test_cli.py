"""The `intentledger` command's corners (issue 13, defect 11), as a person meets them."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
from typer.main import get_command

from intentledger.api.auth import hash_token
from intentledger.cli import app
from intentledger.settings import Settings
from intentledger.store.database import create_ledger_engine
from intentledger.store.ledger import Ledger
from tests.support import INTENTLEDGER


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*INTENTLEDGER, *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("command", [["ops", "list"], ["ops", "show", "op_x"], ["keys", "list"]])
def test_a_missing_database_is_one_line_and_no_file(tmp_path: Path, command: list[str]) -> None:
    path = tmp_path / "nowhere.db"
    done = run(*command, "--database-url", f"sqlite:///{path}")
    assert done.returncode == 1, done
    assert "run `intentledger migrate` first" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not path.exists()


def test_an_unmigrated_database_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    done = run("ops", "list", "--database-url", f"sqlite:///{path}")
    assert done.returncode == 1 and "run `intentledger migrate` first" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unknown_operation_is_named_once(database_url: str) -> None:
    done = run("ops", "show", "op_nope", "--database-url", database_url)
    assert done.returncode == 1
    assert done.stderr.strip() == "no operation 'op_nope'"


def test_refund_duplicate_refuses_in_one_line(database_url: str) -> None:
    done = run(
        "ops",
        "refund-duplicate",
        "op_nope",
        "--charge",
        "ch_1",
        "--reason",
        "twice",
        "--database-url",
        database_url,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "no operation 'op_nope'"


def test_keys_are_listed_and_revoked(database_url: str) -> None:
    made = run("keys", "create", "--actor", "kim", "--database-url", database_url)
    assert made.returncode == 0, made
    token = made.stdout.strip().splitlines()[-1]
    fingerprint = hash_token(token)[:12]
    assert fingerprint in made.stderr
    listed = run("keys", "list", "--database-url", database_url)
    assert listed.returncode == 0 and fingerprint in listed.stdout and token not in listed.stdout

    async def key_id_and_lookup() -> tuple[int, object]:
        engine = create_ledger_engine(database_url)
        try:
            async with engine.connect() as conn:
                ledger = Ledger(conn)
                [row] = [r for r in await ledger.api_keys() if r.actor == "kim"]
                return row.id, await ledger.find_api_key(row.token_hash)
        finally:
            await engine.dispose()

    key_id, found = asyncio.run(key_id_and_lookup())
    assert found is not None
    revoked = run("keys", "revoke", str(key_id), "--database-url", database_url)
    assert revoked.returncode == 0 and "revoked" in revoked.stderr
    assert asyncio.run(key_id_and_lookup())[1] is None  # authenticates nothing now
    assert run("keys", "revoke", "999999", "--database-url", database_url).returncode == 1


def _flags(command: str) -> set[str]:
    click_app = get_command(app)
    sub = click_app.commands[command]  # type: ignore[attr-defined]
    return {opt for param in sub.params for opt in param.opts}


@pytest.mark.parametrize(
    ("command", "not_applicable"),
    [
        # A secret key is read from the environment only (`ps` shows a command line).
        # serve answers GET /metrics on its own port: no metrics server of its own.
        (
            "serve",
            {
                "break_for_tests",
                "short_retention_for_tests",
                "stripe_api_key",
                "stripe_webhook_secret",
                "metrics_port",
            },
        ),
        (
            "worker",
            {
                "break_for_tests",
                "short_retention_for_tests",
                "stripe_api_key",
                "stripe_webhook_secret",
                "sandbox_webhook_secret",
                "sandbox_database",
                "header_timeout",
                "body_timeout",
                "max_connections",
                # The console's work queue is the API's.
                "operator_queue_after",
            },
        ),
    ],
)
def test_every_setting_is_a_flag_of_the_same_name(command: str, not_applicable: set[str]) -> None:
    """README: INTENTLEDGER_X is also --x (the *_for_tests ones are test-only variables)."""
    wanted = {f"--{name.replace('_', '-')}" for name in Settings.model_fields} - {
        f"--{name.replace('_', '-')}" for name in not_applicable
    }
    assert wanted <= _flags(command), wanted - _flags(command)


def test_bench_help_speaks_of_the_docs_not_of_issue_numbers() -> None:
    done = run("bench", "--help")
    assert done.returncode == 0 and "issue" not in done.stdout.lower()
