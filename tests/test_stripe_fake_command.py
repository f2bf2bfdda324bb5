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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    """The commands of each console block under "Trying it locally"."""
    return documented_blocks(documented_section(TRYING_IT))


def documented_blocks(section: str) -> list[list[str]]:
    """Each console block's commands, a command with its backslash continuations
    kept as written."""
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


def documented_section(heading: str) -> str:
    text = (ROOT / "docs" / "providers.md").read_text()
    start = text.index(f"\n{heading}\n")
    return text[start : text.index("\n### ", start + len(heading))]


@dataclass
class Tryout:
    """The fake's terminal and a running `intentledger serve`, as the docs start them."""

    fake: subprocess.Popen[bytes]
    fake_log: Path
    ledger_log: Path
    token: str
    truth_base: str
    workdir: Path
    here: Callable[[list[str]], list[str]]

    def shop(self, command: str) -> str:
        """`command` in the third terminal, the token set as the docs say."""
        return run_in_terminal(self.here([f"TOKEN={self.token}", command]), self.workdir)

    def operation(self, look: str, op_id: str) -> dict[str, Any]:
        shown: dict[str, Any] = json.loads(self.shop(look.replace("op_...", op_id)))
        return shown

    def intents_of(self, op_id: str) -> list[Any]:
        """What localstripe holds under our reference, read with the official SDK."""
        truth = stripe.StripeClient(
            "sk_test_fake", base_addresses={"api": self.truth_base}, max_network_retries=0
        )
        listed = truth.v1.payment_intents.list(params={"limit": 100})
        return [
            intent
            for intent in listed.auto_paging_iter()
            if intent.metadata.to_dict().get("intentledger_reference") == op_id
        ]


@contextmanager
def tried(fake_commands: list[str], ledger_commands: list[str], workdir: Path) -> Iterator[Tryout]:
    stripe_port, ledger_port = free_port(), free_port()

    def here(commands: list[str]) -> list[str]:
        return [as_run_here(c, stripe_port, ledger_port) for c in commands]

    fake_log, ledger_log = workdir / "fake.log", workdir / "ledger.log"
    with (
        terminal(here(fake_commands), ROOT, fake_log) as fake,
        terminal(here(ledger_commands), workdir, ledger_log) as ledger,
    ):
        wait_for_line(fake_log, r"^(Ctrl-C stops both\.)$", fake, "the fake's banner")
        banner = fake_log.read_text()
        api_base = f"http://127.0.0.1:{stripe_port}"
        assert f"INTENTLEDGER_STRIPE_API_BASE={api_base} intentledger serve" in banner
        truth_base = wait_for_line(
            fake_log, r"localstripe itself \(the truth, no faults\): (\S+)", fake, "localstripe"
        )
        token = wait_for_line(ledger_log, r"^(il_\S+)$", ledger, "the key's token")

        def healthy() -> bool:
            assert ledger.poll() is None, ledger_log.read_text()
            try:
                url = f"http://127.0.0.1:{ledger_port}/healthz"
                return httpx.get(url, timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, "intentledger serve to answer")
        yield Tryout(fake, fake_log, ledger_log, token, truth_base, workdir, here)


def paid(tryout: Tryout, pay: str) -> str:
    """The documented payment's operation id, after checking its 202."""
    answer = tryout.shop(pay)
    head, _, body = answer.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 202"), answer
    accepted = json.loads(body)
    assert accepted["state"] == "ACCEPTED"
    return str(accepted["id"])


def test_the_documented_commands_settle_a_pm_card_visa_payment_through_the_fake(
    tmp_path: Path,
) -> None:
    fake_terminal, ledger_terminal, shop_terminal = documented_terminals()
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

    with tried(fake_terminal, ledger_terminal, tmp_path) as tryout:
        op_id = paid(tryout, pay)
        operation: dict[str, Any] = {}

        def settled() -> bool:
            operation.update(tryout.operation(look, op_id))
            return operation["state"] == "OUTCOME_KNOWN"

        wait_until(settled, 30, f"{op_id} to settle", interval=0.3)
        assert operation["outcome"] == "succeeded", operation
        intents = tryout.intents_of(op_id)
        assert [(i.status, i.amount, i.currency) for i in intents] == [("succeeded", 1250, "eur")]
        assert operation["provider_reference"] == intents[0].id

        # Ctrl-C in the fake's terminal: the whole group gets SIGINT.
        os.killpg(tryout.fake.pid, signal.SIGINT)
        tryout.fake.wait(timeout=15)
        wait_until(lambda: not group_alive(tryout.fake.pid), 10, "the fake's processes to end")
        assert "Stripe fake stopped" in tryout.fake_log.read_text()


def test_the_fakes_documented_webhook_forwarding_reaches_serve(tmp_path: Path) -> None:
    """docs/providers.md, "Webhooks": the fake started with a secret and a
    forwarding URL, `serve` with that secret; localstripe's signed event for
    the payment is stored as evidence on the operation."""
    _, ledger_terminal, (_, pay, look) = documented_terminals()
    listen, forwarding = documented_blocks(documented_section("### Webhooks"))
    assert listen[0].startswith("stripe listen --forward-to")
    fake_command, serve_line = forwarding
    assert "--forward-webhooks-to http://127.0.0.1:8000/v1/provider-webhooks/stripe" in (
        fake_command
    )
    assert "INTENTLEDGER_STRIPE_WEBHOOK_SECRET=whsec_local" in serve_line

    with tried([fake_command], [*ledger_terminal[:-1], serve_line], tmp_path) as tryout:
        op_id = paid(tryout, pay)
        events: list[dict[str, Any]] = []

        def forwarded() -> bool:
            timeline = tryout.shop(look.replace("op_...", f"{op_id}/events"))
            events[:] = [
                e
                for e in json.loads(timeline)["data"]
                if e["type"] == "observation" and e["source"] == "webhook:stripe"
            ]
            return bool(events)

        wait_until(forwarded, 30, "localstripe's event to reach serve", interval=0.3)
        (event,) = events
        assert event["kind"] == "provider_event" and event["verdict"] == "succeeded"
        assert event["detail"]["type"] == "payment_intent.succeeded"
        assert tryout.operation(look, op_id)["outcome"] == "succeeded"


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
