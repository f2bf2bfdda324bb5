"""The Stripe fake's documented command, run as docs/providers.md says.

"Trying it locally" has three terminals: the fake; a database, a key and
`intentledger serve` with the Stripe provider; a payment with curl. Each runs
here as a real shell running that block's own text, with only the ports
changed (the documented 12111 and 8000 may be taken), the activation of
`.venv` done by putting this interpreter's directory first on PATH, and the
token and operation id the earlier commands printed filled in. What the fake
holds is read back from localstripe with the official SDK.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import stripe

from intentledger.ports import free_port
from tests.support import wait_until

ROOT = Path(__file__).resolve().parent.parent
TRYING_IT = "### Trying it locally"
DOCUMENTED_STRIPE_PORT = "12111"
DOCUMENTED_LEDGER = "127.0.0.1:8000"


def documented_terminals() -> list[list[str]]:
    """The commands of each console block under "Trying it locally", a command
    with its backslash continuations kept as written."""
    text = (ROOT / "docs" / "providers.md").read_text()
    start = text.index(f"\n{TRYING_IT}\n")
    section = text[start : text.index("\n### ", start + len(TRYING_IT))]
    terminals = []
    for block in re.findall(r"```console\n(.*?)```", section, re.S):
        commands: list[str] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                commands.append(line[2:])
            elif commands and commands[-1].endswith("\\"):
                commands[-1] += "\n" + line
        terminals.append(commands)
    return terminals


def as_run_here(command: str, stripe_port: int, ledger_port: int) -> str:
    command = command.replace(DOCUMENTED_STRIPE_PORT, str(stripe_port))
    command = command.replace(DOCUMENTED_LEDGER, f"127.0.0.1:{ledger_port}")
    return re.sub(r"\bintentledger serve$", f"intentledger serve --port {ledger_port}", command)


def terminal_env() -> dict[str, str]:
    """A fresh terminal with `.venv` active: no INTENTLEDGER_* settings of the
    test run, this interpreter's scripts (`python`, `intentledger`) first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTENTLEDGER_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def script(commands: list[str]) -> str:
    activate = ". .venv/bin/activate"
    return "set -e\n" + "\n".join(c for c in commands if c != activate)


@contextmanager
def terminal(commands: list[str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The commands in one shell of their own session (a terminal's process
    group); whatever is still running in it is stopped at the end."""
    with log.open("ab") as output:
        shell = subprocess.Popen(
            ["sh", "-c", script(commands)],
            cwd=cwd,
            env=terminal_env(),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield shell
        finally:
            if group_alive(shell.pid):
                os.killpg(shell.pid, signal.SIGTERM)
            try:
                shell.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(shell.pid, signal.SIGKILL)
                shell.wait(timeout=5)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_line(log: Path, pattern: str, shell: subprocess.Popen[bytes], what: str) -> str:
    found: list[str] = []

    def printed() -> bool:
        text = log.read_text(errors="replace")
        if match := re.search(pattern, text, re.M):
            found.append(match.group(1))
            return True
        assert shell.poll() is None, f"{what}: the shell ended ({shell.returncode}):\n{text}"
        return False

    wait_until(printed, 60, what, interval=0.1)
    return found[0]


def run_in_terminal(commands: list[str], cwd: Path) -> str:
    done = subprocess.run(
        ["sh", "-c", script(commands)],
        cwd=cwd,
        env=terminal_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_documented_commands_settle_a_pm_card_visa_payment_through_the_fake(
    tmp_path: Path,
) -> None:
    fake_terminal, ledger_terminal, shop_terminal = documented_terminals()
    stripe_port, ledger_port = free_port(), free_port()

    def here(commands: list[str]) -> list[str]:
        return [as_run_here(c, stripe_port, ledger_port) for c in commands]

    assert "python -m tests.stripe_fake serve --port 12111" in fake_terminal
    serve_line = ledger_terminal[-1]
    for setting in (
        "INTENTLEDGER_PROVIDER=stripe",
        "INTENTLEDGER_STRIPE_API_KEY=sk_test_",
        "INTENTLEDGER_STRIPE_API_BASE=http://127.0.0.1:12111",
    ):
        assert setting in serve_line
    assert serve_line.endswith("intentledger serve")
    token_line, pay, look = shop_terminal
    assert token_line.startswith("TOKEN=il_...")
    assert '"payment_method": "pm_card_visa"' in pay

    fake_log, ledger_log = tmp_path / "fake.log", tmp_path / "ledger.log"
    with (
        terminal(here(fake_terminal), ROOT, fake_log) as fake,
        terminal(here(ledger_terminal), tmp_path, ledger_log) as ledger,
    ):
        api_base = f"http://127.0.0.1:{stripe_port}"
        wait_for_line(fake_log, r"^(Ctrl-C stops both\.)$", fake, "the fake's banner")
        banner = fake_log.read_text()
        assert f"INTENTLEDGER_STRIPE_API_BASE={api_base} intentledger serve" in banner
        truth_base = re.search(r"localstripe itself \(the truth, no faults\): (\S+)", banner)
        assert truth_base is not None, banner
        token = wait_for_line(ledger_log, r"^(il_\S+)$", ledger, "the key's token")
        url = f"http://127.0.0.1:{ledger_port}"

        def healthy() -> bool:
            assert ledger.poll() is None, ledger_log.read_text()
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, "intentledger serve to answer")

        answer = run_in_terminal(here([f"TOKEN={token}", pay]), tmp_path)
        head, _, body = answer.replace("\r\n", "\n").partition("\n\n")
        assert head.startswith("HTTP/1.1 202"), answer
        accepted = json.loads(body)
        assert accepted["state"] == "ACCEPTED"
        op_id = accepted["id"]

        operation: dict[str, Any] = {}

        def settled() -> bool:
            shown = run_in_terminal(
                here([f"TOKEN={token}", look.replace("op_...", op_id)]), tmp_path
            )
            operation.update(json.loads(shown))
            return operation["state"] == "OUTCOME_KNOWN"

        wait_until(settled, 30, f"{op_id} to settle", interval=0.3)
        assert operation["outcome"] == "succeeded", operation

        truth = stripe.StripeClient(
            "sk_test_fake", base_addresses={"api": truth_base.group(1)}, max_network_retries=0
        )
        intents = [
            intent
            for intent in truth.v1.payment_intents.list(params={"limit": 100}).auto_paging_iter()
            if intent.metadata.to_dict().get("intentledger_reference") == op_id
        ]
        assert [(i.status, i.amount, i.currency) for i in intents] == [("succeeded", 1250, "eur")]

        # Ctrl-C in the fake's terminal: the whole group gets SIGINT.
        os.killpg(fake.pid, signal.SIGINT)
        fake.wait(timeout=15)
        wait_until(lambda: not group_alive(fake.pid), 10, "the fake's processes to end")
        assert "Stripe fake stopped" in fake_log.read_text()


def start_fake(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.stripe_fake", "serve", "--port", str(port)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_sigterm_to_the_command_stops_localstripe_and_the_proxy(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "fake.log"
    fake = start_fake(port, log)
    try:
        wait_for_line(log, r"^(Ctrl-C stops both\.)$", fake, "the fake's banner")
        assert len(children_of(fake.pid)) == 2
        os.kill(fake.pid, signal.SIGTERM)  # the command alone, not its group
        assert fake.wait(timeout=15) == 0, log.read_text()
        wait_until(lambda: not group_alive(fake.pid), 10, "localstripe and the proxy to end")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/payment_intents", timeout=2)
    finally:
        if group_alive(fake.pid):
            os.killpg(fake.pid, signal.SIGKILL)
        fake.wait(timeout=5)


def children_of(pid: int) -> list[int]:
    listed = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    )
    return [int(p) for p in listed.stdout.split()]


def test_a_taken_port_is_said_plainly(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        log = tmp_path / "fake.log"
        fake = start_fake(port, log)
        try:
            assert fake.wait(timeout=30) == 1
        finally:
            if fake.poll() is None:
                os.killpg(fake.pid, signal.SIGKILL)
                fake.wait(timeout=5)
        output = log.read_text()
        assert "the Stripe fake did not start" in output
        assert "address already in use" in output.lower(), output
        assert not group_alive(fake.pid)
