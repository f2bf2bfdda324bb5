"""The chaos soak's short retention (`intentledger chaos --retention`): the
normal `intentledger` command, whose replay window (and so record retention)
may be as short as SHORTEST_TEST_REPLAY_WINDOW instead of an hour, so that
keys expire and settled records are reaped within a run.

It lives in the tools, not behind a setting of the service, so that no shipped
ledger can be switched into keys that expire in minutes.

    python -m intentledger_tools.short_retention [--run MODULE] COMMAND [options]

MODULE (default: intentledger.cli, the command itself) may be another of the
tools' builds of the command, whose `main()` is then run with the lower floor:
`--run intentledger_tools.blind_retry worker` for a mutation run that reaps.

How: `Settings`' own validator stays the one place the floor is checked; it
compares the window with its class attribute `shortest_replay_window`. This
module installs, where the command builds its settings (`cli.Settings`, as
blind_retry installs its reconciler), a subclass that lowers that attribute
and adds the guards a lower floor needs: the sandbox provider only, so that
no real provider is ever called on keys this short. A subclass rather than
rebinding a constant of the settings module: the rule's check is unchanged,
the guards run in the same validation as it, and nothing the service shares
is changed for other code in the process.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import ClassVar, Self
from unittest.mock import patch

from pydantic import model_validator

from intentledger import cli
from intentledger.domain.durations import format_duration
from intentledger.settings import Settings

# Never shorter than a client's retries after a lost answer last (the chaos
# client's: 2 minutes), or a careful retry would be refused as an expired key.
SHORTEST_TEST_REPLAY_WINDOW = timedelta(minutes=3)

log = logging.getLogger("intentledger")


class ShortRetentionSettings(Settings):
    shortest_replay_window: ClassVar[timedelta] = SHORTEST_TEST_REPLAY_WINDOW

    @model_validator(mode="after")
    def _sandbox_only(self) -> Self:
        if self.provider != "sandbox":
            raise ValueError("a short retention is for the sandbox provider only")
        return self


# The command's own, which the warning follows (logging as it configures it:
# JSON lines under --log-format json).
_configure_logging = cli._configure_logging


def _configure_logging_and_warn(settings: Settings) -> None:
    _configure_logging(settings)
    log.warning(
        "a short retention (intentledger_tools.short_retention): keys expire and records "
        "are reaped after %s; this is for the soak test only, never for a real ledger",
        format_duration(settings.replay_window),
    )


def main() -> None:
    args = sys.argv[1:]
    run: Callable[[], object] = cli.app
    if args[:1] == ["--run"] and len(args) > 1:
        if args[1] != cli.__name__:
            run = importlib.import_module(args[1]).main
        sys.argv[1:] = args[2:]
    with (
        patch.object(cli, "Settings", ShortRetentionSettings),
        patch.object(cli, "_configure_logging", _configure_logging_and_warn),
    ):
        run()


if __name__ == "__main__":
    main()
