"""A sandbox provider whose `pm_slow` answers after a chosen delay (the CLI fixes 1 s).

python -m intentledger_tools.bench.slow_sandbox --port P --database FILE --slow-seconds 0.2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import timedelta

from starlette.applications import Starlette
from starlette.routing import Mount

from intentledger import eventloop
from intentledger.providers.sandbox import create_sandbox_app
from intentledger.service import SANDBOX_MOUNT


def build(database: str, slow_seconds: float) -> Starlette:
    sandbox = create_sandbox_app(database, timedelta(hours=24), slow_seconds=slow_seconds)
    return Starlette(routes=[Mount(SANDBOX_MOUNT, sandbox)])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--database", required=True)
    parser.add_argument("--slow-seconds", type=float, default=0.2)
    args = parser.parse_args(argv)
    eventloop.serve(
        build(args.database, args.slow_seconds),
        # A provider takes on new connections while busy (eventloop.EAGER_ACCEPT_LOOP).
        eager_accept=True,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        # A held answer is on purpose: do not wait for it on shutdown.
        timeout_graceful_shutdown=2,
    )


if __name__ == "__main__":
    main()
