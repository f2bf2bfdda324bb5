"""README's "Try it" runs as written: its curl commands show the status line and
the `Idempotent-Replayed` header the text talks about."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.served import Served

README = Path(__file__).resolve().parent.parent / "README.md"


def try_it_commands() -> list[str]:
    section = README.read_text().split("## Try it", 1)[1].split("\n## ", 1)[0]
    block = section.split("```console", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        if line.startswith("$ ") and not current:
            current = line[2:]
        elif current:
            current += "\n" + line
        if current and not current.endswith("\\"):
            commands.append(current)
            current = ""
    return [command for command in commands if command.startswith("curl")]


def test_every_curl_in_try_it_shows_the_status_and_headers() -> None:
    commands = try_it_commands()
    assert len(commands) == 3, commands
    for command in commands:
        assert re.match(r"curl -\w*i\b", command), command


def test_the_payment_curl_shows_202_then_the_replay_header(served: Served) -> None:
    # scripts/ensure-test-tools installs curl: the suite never skips a missing tool.
    assert shutil.which("curl"), "curl is missing: run scripts/ensure-test-tools"
    [pay] = [command for command in try_it_commands() if "/v1/payments" in command]
    pay = pay.replace("http://127.0.0.1:8000", served.url)
    token = served.auth["Authorization"].removeprefix("Bearer ")

    def send() -> str:
        done = subprocess.run(
            ["sh", "-c", pay],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "TOKEN": token},
        )
        assert done.returncode == 0, done
        return done.stdout

    first, again = send(), send()
    assert first.startswith("HTTP/1.1 202 Accepted"), first
    assert '"state":"ACCEPTED"' in first.replace(" ", "")
    assert again.startswith("HTTP/1.1 200 OK"), again
    assert "idempotent-replayed: true" in again.lower(), again
