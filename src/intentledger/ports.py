"""A free loopback port for a server we are about to start in another process.

Asking the kernel to bind port 0 hands out a port from its ephemeral range, the
same range it takes the local port of every outgoing connection from. Between
learning such a port and the child process binding it, any outgoing connection
on the machine (a test's HTTP client, a pooled database connection) may take
it, and the child dies with EADDRINUSE; a server restarted on its old port
runs the same risk while it is down. Ports below the ephemeral range are never
handed to outgoing connections, so one found free there stays free unless
another process binds it on purpose. The choice is random so that concurrent
callers (two test workers) rarely pick the same one, and the check binds both
the IPv4 loopback and the IPv6 wildcard, because some servers (localstripe)
listen on `::`.

Run as a script (`python3 src/intentledger/ports.py`) it prints one port, for
shell scripts; it needs nothing outside the standard library.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000  # clear of the well-known and most registered services' ports
_ATTEMPTS = 200
# Not the module's shared generator: hypothesis seeds that one inside its tests,
# which would hand every test process the same sequence of ports.
_RANDOM = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default range starts here


def _ipv6_usable() -> bool:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.bind(("::1", 0))
        return True
    return False


def _bindable(port: int, ipv6: bool) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
        if ipv6:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
                sock.bind(("::", port))
    except OSError:
        return False
    return True


def free_port() -> int:
    """A loopback port below the ephemeral range that nothing is bound to now."""
    low = _ephemeral_low()
    if low - _LOWEST >= 1_000:
        ipv6 = _ipv6_usable()
        for _ in range(_ATTEMPTS):
            port = _RANDOM.randrange(_LOWEST, low)
            if _bindable(port, ipv6):
                return port
    # A machine whose ephemeral range leaves no room below it: the kernel's choice.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    print(free_port())
