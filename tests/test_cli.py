"""The `intentledger` command's corners (issue 13, defect 11), as a person meets them."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import pwd
import signal
import socket
import struct
import subprocess
import termios
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic.script import ScriptDirectory
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from typer.main import get_command

from intentledger.app import create_app
from intentledger.cli import app
from intentledger.domain.canonical import request_hash
from intentledger.domain.states import NextAction, State
from intentledger.engine import changes
from intentledger.engine.api_keys import create_api_key, hash_token
from intentledger.engine.clock import system_clock
from intentledger.engine.intake import Intent, accept
from intentledger.ports import free_port
from intentledger.settings import Settings
from intentledger.store.database import create_ledger_engine
from intentledger.store.ledger import Ledger
from intentledger.store.migrate import alembic_config
from intentledger.store.tables import decisions
from tests.served import serve
from tests.support import INTENTLEDGER, Process


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


def _key_row(database_url: str, actor: str) -> Any:
    async def read() -> Any:
        engine = create_ledger_engine(database_url)
        try:
            async with engine.connect() as conn:
                [row] = [r for r in await Ledger(conn).api_keys() if r.actor == actor]
                return row
        finally:
            await engine.dispose()

    return asyncio.run(read())


def _authenticates(database_url: str, token: str) -> bool:
    async def find() -> bool:
        engine = create_ledger_engine(database_url)
        try:
            async with engine.connect() as conn:
                return await Ledger(conn).find_api_key(hash_token(token)) is not None
        finally:
            await engine.dispose()

    return asyncio.run(find())


def test_keys_create_prints_the_id_revoke_takes_and_revoke_takes_the_fingerprint_too(
    database_url: str,
) -> None:
    made = run("keys", "create", "--actor", "kim", "--database-url", database_url)
    assert made.returncode == 0, made
    token = made.stdout.strip().splitlines()[-1]
    fingerprint = hash_token(token)[:12]
    kim = _key_row(database_url, "kim")
    # What it prints is what `keys revoke` takes: the id (and the fingerprint).
    assert f"key {kim.id} (fingerprint {fingerprint})" in made.stderr, made.stderr
    assert f"intentledger keys revoke {kim.id}" in made.stderr
    listed = run("keys", "list", "--database-url", database_url)
    assert listed.returncode == 0 and fingerprint in listed.stdout and token not in listed.stdout
    on_80_columns = _on_a_terminal(80, "keys", "list", "--database-url", database_url)
    assert max(len(line) for line in on_80_columns.splitlines()) <= 80, on_80_columns
    assert {str(kim.id), fingerprint} <= set(on_80_columns.split()), on_80_columns

    revoked = run("keys", "revoke", str(kim.id), "--database-url", database_url)
    assert revoked.returncode == 0, revoked
    assert f"key {kim.id} (fingerprint {fingerprint}, actor 'kim') revoked" in revoked.stderr
    assert not _authenticates(database_url, token)  # authenticates nothing now

    other = run("keys", "create", "--actor", "lou", "--database-url", database_url)
    other_token = other.stdout.strip().splitlines()[-1]
    by_fingerprint = run(
        "keys", "revoke", hash_token(other_token)[:12], "--database-url", database_url
    )
    assert by_fingerprint.returncode == 0, by_fingerprint
    assert not _authenticates(database_url, other_token)

    for unknown in ("999999", "0123456789ab", "kim"):
        refused = run("keys", "revoke", unknown, "--database-url", database_url)
        assert refused.returncode == 1, refused
        assert refused.stderr.strip() == (
            f"no key {unknown!r}: give its id or fingerprint from `intentledger keys list`"
        )


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
                "stripe_api_key",
                "stripe_webhook_secret",
                "adyen_api_key",
                "adyen_hmac_keys",
                "metrics_port",
                "metrics_host",
            },
        ),
        (
            "worker",
            {
                "stripe_api_key",
                "stripe_webhook_secret",
                "adyen_api_key",
                "adyen_hmac_keys",
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
    """README: INTENTLEDGER_X is also --x."""
    wanted = {f"--{name.replace('_', '-')}" for name in Settings.model_fields} - {
        f"--{name.replace('_', '-')}" for name in not_applicable
    }
    assert wanted <= _flags(command), wanted - _flags(command)


def test_bench_help_speaks_of_the_docs_not_of_issue_numbers() -> None:
    done = run("bench", "--help")
    assert done.returncode == 0 and "issue" not in done.stdout.lower()


# -- amounts one way, tables at 80 columns and off a terminal --------------------------------

PAYMENTS = "POST /v1/payments"
LONG_ACTOR = "the-merchant-team-with-a-long-name-in-the-north-region"


async def _accept(database_url: str, amount: int, currency: str, actor: str = "dora") -> str:
    body = {"amount": amount, "currency": currency, "payment_method": "pm_ok", "metadata": {}}
    engine = create_ledger_engine(database_url)
    try:
        accepted = await accept(
            engine,
            system_clock,
            Intent(
                actor=actor,
                route=PAYMENTS,
                idempotency_key=f"k-{amount}-{currency}-{time.time_ns()}",
                request_hash=request_hash(actor, PAYMENTS, body),
                body=body,
                provider="sandbox",
            ),
        )
        return str(accepted.operation["operation_id"])
    finally:
        await engine.dispose()


def _on_a_terminal(columns: int, *args: str) -> str:
    """The command's output on a real pseudo-terminal `columns` wide."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    process = subprocess.Popen(
        [*INTENTLEDGER, *args],
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env={**env, "TERM": "dumb"},
    )
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the command is done
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(timeout=60) == 0, output
    return output.decode().replace("\r\n", "\n")


SHOWN = {(4200, "EUR"): "42.00 EUR (4200)", (4200, "JPY"): "4200 JPY (4200)"}


def test_ops_list_and_show_show_amounts_one_way_whole_in_a_pipe_and_at_80_columns(
    database_url: str,
) -> None:
    made = {
        asyncio.run(_accept(database_url, amount, currency, LONG_ACTOR)): shown
        for (amount, currency), shown in SHOWN.items()
    }

    # Off a terminal, whatever COLUMNS says: each operation's id and amount whole
    # on one line, so that grep finds them together.
    piped = subprocess.run(
        [*INTENTLEDGER, "ops", "list", "--database-url", database_url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert piped.returncode == 0, piped
    assert "…" not in piped.stdout
    for operation_id, shown in made.items():
        [line] = [line for line in piped.stdout.splitlines() if operation_id in line]
        assert shown in line, piped.stdout
    assert LONG_ACTOR in piped.stdout

    # On an 80-column terminal: nothing wider, no id cut, amounts broken only at spaces.
    seen = _on_a_terminal(80, "ops", "list", "--database-url", database_url)
    assert max(len(line) for line in seen.splitlines()) <= 80, seen
    assert "…" not in seen
    words = seen.split()
    for operation_id, shown in made.items():
        assert operation_id in words, seen
        assert all(part in words for part in shown.split()), seen

    operation_id, shown = next(iter(made.items()))
    detail = run("ops", "show", operation_id, "--database-url", database_url)
    assert detail.returncode == 0, detail
    [amount_line] = [line for line in detail.stdout.splitlines() if " amount " in line]
    assert shown in amount_line and "currency" not in detail.stdout, detail.stdout

    # An operation that moves no money (a beneficiary) has a dash, not "None None".
    beneficiary = asyncio.run(_accept_beneficiary(database_url))
    listed = run("ops", "list", "--database-url", database_url)
    [line] = [line for line in listed.stdout.splitlines() if beneficiary in line]
    assert "—" in line and "None" not in listed.stdout, listed.stdout
    shown_alone = run("ops", "show", beneficiary, "--database-url", database_url)
    [amount_line] = [line for line in shown_alone.stdout.splitlines() if " amount " in line]
    assert "—" in amount_line and "None" not in shown_alone.stdout, shown_alone.stdout


async def _accept_beneficiary(database_url: str) -> str:
    body = {"name": "Ada Lovelace", "iban": "GB82WEST12345698765432"}
    route = "POST /v1/beneficiaries"
    engine = create_ledger_engine(database_url)
    try:
        accepted = await accept(
            engine,
            system_clock,
            Intent(
                actor="dora",
                route=route,
                idempotency_key=f"b-{time.time_ns()}",
                request_hash=request_hash("dora", route, body),
                body=body,
                provider="sandbox",
                kind="beneficiary",
            ),
        )
        return str(accepted.operation["operation_id"])
    finally:
        await engine.dispose()


# -- small things a newcomer met --------------------------------------------------------------


def test_migrate_says_it_created_the_schema_then_that_it_is_up_to_date(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'new.db'}"
    head = ScriptDirectory.from_config(alembic_config(url)).get_current_head()
    created = run("migrate", "--database-url", url)
    assert created.returncode == 0, created
    assert created.stderr.strip() == f"created the schema (revision {head})"
    again = run("migrate", "--database-url", url)
    assert again.returncode == 0, again
    assert again.stderr.strip() == f"the schema is up to date (revision {head})"


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_stripe_api_key_is_named_as_read_from_the_environment_only(command: str) -> None:
    help_text = subprocess.run(
        [*INTENTLEDGER, command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "400"},
    ).stdout
    [line] = [line for line in help_text.splitlines() if "--stripe-api-key" in line]
    assert "read from the environment only (INTENTLEDGER_STRIPE_API_KEY)" in line, line
    given = run(command, "--stripe-api-key", "sk_test_on_the_command_line")
    assert given.returncode == 2, given
    assert "set INTENTLEDGER_STRIPE_API_KEY in the environment" in given.stderr
    assert "sk_test_on_the_command_line" not in given.stderr + given.stdout


def test_serve_logs_one_line_when_it_stops(database_url: str, tmp_path: Path) -> None:
    process, url = serve(database_url, tmp_path, "24h")
    try:
        process.wait_healthy(url + "/healthz")
        process.popen.send_signal(signal.SIGTERM)
        process.popen.wait(timeout=30)
    finally:
        process.stop()
    stopped = [line for line in process.output().splitlines() if "stopped" in line]
    assert len(stopped) == 1, process.output()
    assert stopped[0].endswith(f"intentledger serving on {url} stopped (SIGTERM)"), stopped


def test_a_worker_binds_its_metrics_to_the_host_given_and_logs_one_line_when_it_stops(
    database_url: str, sandbox: str, tmp_path: Path
) -> None:
    port = free_port()
    worker = Process(
        [
            "worker",
            "--database-url",
            database_url,
            "--provider-url",
            sandbox,
            "--metrics-port",
            str(port),
            "--metrics-host",
            "127.0.0.2",
        ],
        {},
        tmp_path / "worker.log",
    )
    try:
        worker.wait_healthy(f"http://127.0.0.2:{port}/metrics")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
        assert f"worker metrics at http://127.0.0.2:{port}/metrics" in worker.output()
        worker.popen.send_signal(signal.SIGINT)
        worker.popen.wait(timeout=30)
    finally:
        worker.stop()
    stopped = [line for line in worker.output().splitlines() if "stopped" in line]
    assert len(stopped) == 1 and "stopped (SIGINT)" in stopped[0], worker.output()


# -- operator identity from the CLI, and its actions in the console's metrics -----------------


async def _make_unknown(database_url: str, operation_id: str) -> None:
    """The operation's answer was lost (ACCEPTED -> SUBMITTING -> UNKNOWN), as a
    worker records it: a state a person may escalate from."""
    engine = create_ledger_engine(database_url)
    try:
        for target, next_action in (
            (State.SUBMITTING, NextAction.WAIT),
            (State.UNKNOWN, NextAction.RECONCILE),
        ):
            async with engine.begin() as conn:
                ledger = Ledger(conn)
                operation = await ledger.lock_operation(operation_id)
                await changes.transition(
                    ledger,
                    operation,
                    target,
                    now=system_clock(),
                    next_action=next_action,
                    reason="the test's worker",
                    source="worker:test",
                )
    finally:
        await engine.dispose()


async def _decisions_of(database_url: str, operation_id: str) -> list[Any]:
    engine = create_ledger_engine(database_url)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(decisions).where(decisions.c.operation_id == operation_id)
            )
            return list(rows)
    finally:
        await engine.dispose()


async def _escalate_through_the_api_and_scrape(database_url: str, operation_id: str) -> str:
    """An escalation as the console makes it (the operator API's code, in the
    API process), then that process's /metrics."""
    engine = create_ledger_engine(database_url)
    try:
        token = await create_api_key(engine, system_clock, "olive", is_operator=True)
        app = create_app(engine, system_clock, "sandbox")
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api.test"
        ) as client:
            escalated = await client.post(
                f"/v1/ops/operations/{operation_id}/escalate",
                json={"reason": "the merchant called"},
                headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "esc-1"},
            )
            assert escalated.status_code == 200, escalated.text
            return (await client.get("/metrics")).text
    finally:
        await engine.dispose()


def _operator_actions(exposition: str) -> dict[str, float]:
    return {
        sample.labels["rule"]: sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == "intentledger_operator_actions_total"
    }


def _offered(shown: str) -> str:
    """The actions `ops show` offers (domain/operator_rules.py)."""
    [line] = [line for line in shown.splitlines() if line.split(maxsplit=2)[1:2] == ["actions"]]
    return line.split("actions", 1)[1].strip(" │|")


def test_a_cli_action_records_the_os_user_and_host_and_is_counted_with_the_consoles(
    database_url: str,
) -> None:
    by_cli, by_console = (asyncio.run(_accept(database_url, 990, "EUR")) for _ in range(2))
    for operation_id in (by_cli, by_console):
        asyncio.run(_make_unknown(database_url, operation_id))
    unknown = run("ops", "show", by_cli, "--database-url", database_url)
    assert _offered(unknown.stdout) == "resolve, escalate", unknown.stdout

    # The environment is the caller's to set: the record must not believe it.
    escalated = subprocess.run(
        [
            *(*INTENTLEDGER, "ops", "escalate", by_cli),
            *("--reason", "the provider's status page is red", "--by", "Kim on call"),
            *("--database-url", database_url),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "USER": "mallory", "LOGNAME": "mallory", "USERNAME": "mallory"},
    )
    assert escalated.returncode == 0, escalated
    [decision] = asyncio.run(_decisions_of(database_url, by_cli))
    # Declared (anyone may type any name), and marked as typed at the CLI so
    # the console never shows it as a signed-in operator's.
    assert decision.source == "operator:cli:Kim on call"
    assert decision.inputs["by"] == "cli:Kim on call"
    effective = pwd.getpwuid(os.geteuid()).pw_name  # what the machine says
    assert decision.inputs["os_user"].split(" ")[0] == effective != "mallory"
    assert decision.inputs["host"] == socket.gethostname()
    shown = run("ops", "show", by_cli, "--database-url", database_url)
    assert f"typed by OS user {decision.inputs['os_user']} on {socket.gethostname()}" in (
        shown.stdout
    )
    # Escalated, never attempted: nothing to approve a new request of.
    assert _offered(shown.stdout) == "resolve", shown.stdout

    # The API process never saw the CLI's action, and counts it with its own.
    exposition = asyncio.run(_escalate_through_the_api_and_scrape(database_url, by_console))
    assert _operator_actions(exposition) == {"operator_escalation": 2}
    [through_api] = asyncio.run(_decisions_of(database_url, by_console))
    assert "os_user" not in through_api.inputs  # there `by` is the key's actor


def test_an_installed_package_cannot_replace_a_service_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from importlib.metadata import EntryPoint

    import intentledger.cli as cli

    def offered(group: str) -> list[EntryPoint]:
        assert group == "intentledger.commands"
        # A "worker" from elsewhere (the chaos run's broken build is a worker).
        return [EntryPoint("worker", "intentledger.cli:keys_app", "intentledger.commands")]

    before = [(c.name, c.callback) for c in cli.app.registered_commands]
    monkeypatch.setattr(cli, "entry_points", offered)
    cli._register_tool_commands()
    assert [(c.name, c.callback) for c in cli.app.registered_commands] == before


# -- intentledger providers ------------------------------------------------------------------


def test_providers_shows_a_provider_without_lookup_and_what_stands_in_for_it() -> None:
    done = run("providers")
    assert done.returncode == 0, done.stderr
    lines = [line.strip(" │┃|") for line in done.stdout.splitlines()]
    # The retention's minimum (Adyen's 7 days), in whole days, on one line.
    assert any(
        "lookup: none (same-key resend within 7 d, notifications)" in line for line in lines
    ), done.stdout
    assert "lookup: by our reference, strong" in done.stdout  # the sandbox's
    assert "Adyen Checkout API v71" in done.stdout


def test_a_retention_is_shown_in_whole_days_where_it_is_some() -> None:
    from datetime import timedelta

    from intentledger.cli import _in_days

    assert _in_days(timedelta(days=7)) == "7 d"
    assert _in_days(timedelta(days=31)) == "31 d"
    assert _in_days(timedelta(hours=24)) == "1 d"
    assert _in_days(timedelta(hours=6)) == "6h"
