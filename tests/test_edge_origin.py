"""The console's Origin check reads a bracketed IPv6 host (issue 35, item 9):
signing in over plain http at http://[::1]:PORT works like 127.0.0.1 does,
against a real `intentledger serve` bound to the IPv6 loopback, on both
databases. Before, `[::1]:PORT` was not recognised as loopback, so the form
post was refused 403 cross-origin.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from intentledger.ports import free_port
from tests.conftest import BACKENDS, Databases
from tests.support import Process
from tests.test_intake_http import create_key


@pytest.fixture(scope="module", params=BACKENDS)
def database_with_operator(request: pytest.FixtureRequest, databases: Databases) -> tuple[str, str]:
    database_url = databases.create(str(request.param))
    return database_url, create_key(database_url, "otto", operator=True)


@pytest.fixture(params=["::1", "127.0.0.1"])
def console_url(
    request: pytest.FixtureRequest, database_with_operator: tuple[str, str], tmp_path: Path
) -> Iterator[str]:
    host = str(request.param)
    port = free_port()
    proc = Process(
        [
            "serve",
            "--no-workers",
            "--host",
            host,
            "--port",
            str(port),
            "--database-url",
            database_with_operator[0],
        ],
        {},
        tmp_path / "serve.log",
    )
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        proc.wait_healthy(url + "/healthz")
        yield url
    finally:
        proc.stop()


def test_signing_in_over_plain_http_on_loopback(
    console_url: str, database_with_operator: tuple[str, str]
) -> None:
    token = database_with_operator[1]
    with httpx.Client(base_url=console_url) as browser:
        assert browser.get("/console/sign-in").status_code == 200
        # What a browser sends with the form: its Origin, this very URL.
        signed_in = browser.post(
            "/console/sign-in",
            data={"token": token, "next": "/console/queue"},
            headers={"Origin": console_url},
        )
        assert signed_in.status_code == 303, signed_in.text
        cookie = signed_in.headers["set-cookie"]
        # Not `Secure`: over plain http to loopback it must come back.
        assert "secure" not in cookie.lower()
        queue = browser.get("/console/queue")
        assert queue.status_code == 200 and "otto" in queue.text

        foreign = browser.post(
            "/console/sign-in",
            data={"token": token},
            headers={"Origin": "http://attacker.example"},
        )
        assert foreign.status_code == 403


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1:8000", True),
        ("[::1]:8000", True),
        ("localhost", True),
        ("shop.example", False),
        # Not a Host a browser sends: a name with credentials, a path, a query,
        # a fragment or a backslash is no name of this machine.
        ("x@127.0.0.1", False),
        ("127.0.0.1/x", False),
        ("127.0.0.1?x", False),
        ("127.0.0.1#x", False),
        ("evil.example\\@127.0.0.1", False),
        ("[::1", False),
    ],
)
def test_only_a_plain_loopback_host_counts_as_this_machine(host: str, loopback: bool) -> None:
    from intentledger.console.session import _loopback

    assert _loopback(host) is loopback
