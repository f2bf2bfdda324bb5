"""The ports handed to child servers come from below the ephemeral range."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from intentledger import ports
from intentledger.ports import free_port

SCRIPT = Path(ports.__file__)


def test_a_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    low = ports._ephemeral_low()
    for _ in range(20):
        port = free_port()
        # An outgoing connection never takes a port below the ephemeral range,
        # so it stays free between this choice and the child's bind.
        assert ports._LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        real_randrange = ports._RANDOM.randrange
        offered: list[int] = []

        def busy_first(low: int, high: int) -> int:
            offered.append(busy if len(offered) < 2 else real_randrange(low, high))
            return offered[-1]

        # Let the busy port, which sits in the ephemeral range, be a candidate.
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_000)
        monkeypatch.setattr(ports._RANDOM, "randrange", busy_first)
        port = free_port()
    assert offered[:2] == [busy, busy]
    assert port != busy


def test_the_script_prints_one_port_for_shell_scripts() -> None:
    printed = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True
    ).stdout
    assert ports._LOWEST <= int(printed) < ports._ephemeral_low()
