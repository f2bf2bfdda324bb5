"""Long-lived processes run their loop with the thread declared to sniffio; the
sandbox provider runs on a loop that takes on a burst of connections at once."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sniffio
import uvicorn
import uvloop
from typer.testing import CliRunner

from intentledger import cli, eventloop


def test_run_declares_its_thread_for_the_run_only() -> None:
    async def seen() -> str | None:
        return sniffio.thread_local.name

    assert sniffio.thread_local.name is None
    assert eventloop.run(seen()) == "asyncio"
    assert sniffio.thread_local.name is None


def test_a_declared_thread_still_names_asyncio_to_anyio() -> None:
    import anyio

    async def sleep_a_tick() -> str:
        await anyio.lowlevel.checkpoint()
        return sniffio.current_async_library()

    assert eventloop.run(sleep_a_tick()) == "asyncio"


def _accepted_within(loop: asyncio.AbstractEventLoop, waiting: int, turns: int) -> int:
    """Connections a server on `loop` took on within `turns` turns of it, with
    `waiting` clients already through the handshake, queued for accept."""
    made: list[asyncio.BaseTransport] = []

    class Counted(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            made.append(transport)

    async def turn(times: int) -> None:
        for _ in range(times):
            await asyncio.sleep(0)

    try:
        server = loop.run_until_complete(
            loop.create_server(Counted, "127.0.0.1", 0, backlog=2 * waiting)
        )
        port = server.sockets[0].getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(waiting)]
        try:
            loop.run_until_complete(turn(turns))
            return len(made)
        finally:
            for transport in made:
                transport.close()
            for client in clients:
                client.close()
            server.close()
            loop.run_until_complete(turn(3))
    finally:
        loop.close()


def test_the_eager_server_loop_takes_on_every_waiting_connection_at_once() -> None:
    """The sandbox's loop (what uvicorn makes of EAGER_ACCEPT_LOOP) accepts a burst
    of new connections together; uvloop, which the API and workers run on,
    takes one a turn, so a sandbox busy 150-300 ms a turn took ten seconds to
    empty an accept queue of 31 (docs/benchmarks.md, step 46). Ten turns: a
    kernel slow to queue the last handshakes cannot make the eager loop miss."""
    waiting, turns = 40, 10
    eager = uvicorn.Config(app=None, loop=eventloop.EAGER_ACCEPT_LOOP).get_loop_factory()
    assert eager is not None
    assert _accepted_within(eager(), waiting, turns) == waiting
    assert _accepted_within(uvloop.new_event_loop(), waiting, turns) < waiting // 2


def test_the_sandbox_command_serves_on_the_eager_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[dict[str, Any]] = []
    monkeypatch.setattr(eventloop, "serve", lambda app, **options: served.append(options))
    result = CliRunner().invoke(cli.app, ["sandbox", "--port", "1"])
    assert result.exit_code == 0, result.output
    assert served and served[0]["eager_accept"] is True


def test_eager_accept_picks_the_loop_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    import uvicorn as real

    runs: list[dict[str, Any]] = []
    monkeypatch.setattr(real, "run", lambda app, **options: runs.append(options))
    eventloop.serve(None, eager_accept=True, port=1)
    eventloop.serve(None, port=2, loop="uvloop")
    assert runs == [
        {"loop": eventloop.EAGER_ACCEPT_LOOP, "port": 1},
        {"port": 2, "loop": "uvloop"},
    ]
    with pytest.raises(ValueError, match="eager_accept chooses the loop"):
        eventloop.serve(None, eager_accept=True, loop="uvloop")


def test_the_frozen_start_is_never_walked_and_what_comes_after_is_still_collected() -> None:
    """In a process of its own, as a worker or server calls it: the start's own
    garbage is collected first, not frozen; what the imports made is out of the
    collector's walks; a cycle made afterwards is still freed, and the youngest
    generation waits for more than CPython's 700 objects, not for ever."""
    script = """
import gc, weakref
import intentledger.cli
from intentledger import eventloop

class Node:
    pass

def cycle():
    node = Node()
    node.me = node
    return node

left_behind = cycle()
collected_first = weakref.ref(left_behind)
before = cycle()
kept_before = weakref.ref(before)
del left_behind
eventloop.freeze_what_starts_with_the_process()
assert collected_first() is None, "the start's garbage was frozen, not collected"
assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
assert gc.get_threshold() == (eventloop.YOUNG_GENERATION_THRESHOLD, 10, 10), gc.get_threshold()
after = cycle()
freed_after = weakref.ref(after)
del after, before
gc.collect()
assert freed_after() is None, "a cycle made after the freeze was not collected"
assert kept_before() is not None, "a frozen object was walked"
# Cyclic garbage is still collected on its own, once enough of it is left.
waiting = weakref.ref(cycle())
for made in range(3 * eventloop.YOUNG_GENERATION_THRESHOLD):
    if waiting() is None:
        break
    cycle()
assert waiting() is None, "cyclic garbage was never collected"
assert made > eventloop.YOUNG_GENERATION_THRESHOLD // 2, made
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize(
    ("command", "runs"),
    [
        (["worker", "--provider-url", "http://127.0.0.1:9/_sandbox"], "run"),
        (["serve", "--no-workers", "--port", "1"], "serve"),
    ],
)
def test_the_worker_and_the_server_freeze_their_start_before_they_run(
    command: list[str], runs: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In the test's own process: its logging and its signals stay as they are.
    monkeypatch.setattr(cli, "_configure_logging", lambda _settings: None)
    monkeypatch.setattr(cli, "_log_stop_and_die_on", lambda _signals, _what: None)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    assert CliRunner().invoke(cli.app, ["migrate", "--database-url", url]).exit_code == 0
    calls: list[str] = []
    monkeypatch.setattr(
        eventloop, "freeze_what_starts_with_the_process", lambda: calls.append("freeze")
    )

    def ran(main: Any = None, **_options: Any) -> None:
        if asyncio.iscoroutine(main):
            main.close()
        calls.append(runs)

    monkeypatch.setattr(eventloop, runs, ran)
    result = CliRunner().invoke(cli.app, [*command, "--database-url", url])
    assert result.exit_code == 0, result.output
    assert calls == ["freeze", runs]
