"""Helpers the tests share: free ports, real subprocesses, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from intentledger.ports import free_port
from intentledger.store.direct import DirectConnection

INTENTLEDGER = [sys.executable, "-m", "intentledger.cli"]


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def until_backend(
    engine: AsyncEngine, pid: int, state: Callable[[str | None], bool], seconds: float = 5.0
) -> str | None:
    """What PostgreSQL's server process `pid` waits on, once `state` accepts it
    or `seconds` have passed: None once it is gone, '' while it runs, else its
    `wait_event_type` ('Lock'). Each look is a transaction of its own: a
    transaction's `pg_stat_activity` holds still from its first read, so a
    loop inside one sees the first answer for ever."""
    deadline = time.monotonic() + seconds
    while True:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT coalesce(wait_event_type, '') FROM pg_stat_activity"
                        " WHERE pid = :pid"
                    ),
                    {"pid": pid},
                )
            ).first()
        seen = None if row is None else str(row[0])
        if state(seen) or time.monotonic() >= deadline:
            return seen
        await asyncio.sleep(0.02)


class Process:
    """A real `intentledger` OS process (or `command`'s), its output kept in a log file."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str],
        log: Path,
        command: Sequence[str] = tuple(INTENTLEDGER),
    ) -> None:
        self.command = list(command)
        self.args = list(args)
        self.log = log
        self._log_file = log.open("ab")
        self.popen = subprocess.Popen(
            [*command, *args],
            env={**os.environ, **env},
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_healthy(self, url: str, timeout: float = 30.0) -> None:
        def healthy() -> bool:
            if self.popen.poll() is not None:
                what = " ".join(self.args[:1] if self.command == INTENTLEDGER else self.command)
                raise AssertionError(f"{what} exited early:\n{self.output()}")
            try:
                return httpx.get(url, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout, f"{url} to answer 200")

    def kill(self) -> None:
        """SIGKILL: no cleanup, no graceful shutdown, like a crash."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_file.close()


@contextlib.contextmanager
def serving_module(module: str, log: Path, health: str, *options: str) -> Iterator[str]:
    """`python -m module --port P *options`, a server of the tests' own, until it
    answers 200 at `health`; yields its base URL and stops it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Process(["--port", str(port), *options], {}, log, command=[sys.executable, "-m", module])
    try:
        proc.wait_healthy(f"{url}{health}")
        yield url
    finally:
        proc.stop()


class Forwarder:
    """A TCP forwarder from a loopback port to `target`: a database that is
    'down' until it starts, and goes away again when it stops."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port = port
        self.target = target
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port))
        self._listener = listener
        thread = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            upstream = socket.create_connection(self.target)
            for source, sink in ((client, upstream), (upstream, client)):
                pump = threading.Thread(target=self._pump, args=(source, sink), daemon=True)
                pump.start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()


def counting(engine: AsyncEngine) -> tuple[list[str], Callable[[], None]]:
    """The statements sent from now on, on `engine` (SQLAlchemy's events) and on
    the batched first attempts' own connections (store/direct.py), which send
    SQLAlchemy's statements past its events; and how to stop counting."""
    sent: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    through_engine = DirectConnection.execute

    async def execute(self: DirectConnection, statement: Any, parameters: Any = None) -> Any:
        sent.append(str(statement.compile(dialect=self.dialect)))
        return await through_engine(self, statement, parameters)

    def stop() -> None:
        event.remove(engine.sync_engine, "before_cursor_execute", count)
        DirectConnection.execute = through_engine  # type: ignore[method-assign]

    event.listen(engine.sync_engine, "before_cursor_execute", count)
    DirectConnection.execute = execute  # type: ignore[method-assign]
    return sent, stop
